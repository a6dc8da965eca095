"""Signed admin calls: fleetrl proves it holds the run's admin token without sending it, and
the worker proves the same in its answer (a leaf: imports nothing of fleetrl).

A bearer token goes to whoever answers at a worker's port. After a worker dies, any local
process may take that port, answer /health (which needs no token) and so receive the token
with the next admin call. fleetrl's admin calls therefore carry, instead of the token, an HMAC
of the call (method, path and query, a timestamp, a fresh nonce) keyed by the token. The
worker's middleware (engine/admin_auth.py) checks it, refuses a timestamp off by more than
MAX_SKEW_S or a nonce it has seen, and answers with an HMAC of the nonce keyed by the same
token. A caller that gets no valid proof back is not talking to a server started with the
run's token, and trusts nothing it said. fleetrl's data requests (which carry the data token as a
bearer) name a nonce of their own (NONCE_HEADER), and their answers carry the same proof.
Bearer tokens still open the routes, for an operator's curl.

fleetrl's Dynamo worker kind (engine/dynamo_worker.py) gets the same protection in the JSON body,
the only part of a call its route handlers see: the signature rides in BODY_SIGNATURE_FIELD and
also covers the rest of the body, and the answer carries the proof in BODY_PROOF_FIELD.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

SCHEME = "Fleetrl-HMAC"
# A data request (which carries the data token) may name a nonce here; the answer then carries
# the worker's proof of it, as for a signed admin call.
NONCE_HEADER = "x-fleetrl-nonce"
_HEX = frozenset("0123456789abcdef")
PROOF_HEADER = "x-fleetrl-proof"
# How far a signed call's clock may be from the worker's; a nonce is remembered this long.
MAX_SKEW_S = 300


@dataclass(frozen=True)
class Signature:
    timestamp: int
    nonce: str
    mac: str


def _is_mac(value: object) -> bool:
    """64 lowercase hex digits: what `_mac` makes (anything else is compared with nothing)."""
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def _mac(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def _request_message(method: str, target: str, timestamp: int, nonce: str) -> str:
    return f"fleetrl request\n{method.upper()}\n{target}\n{timestamp}\n{nonce}"


def authorization(token: str, method: str, target: str) -> tuple[str, str]:
    """The Authorization header's value for a call of `method` on `target` (path and query, as
    sent), and the nonce the answer's proof must be made of."""
    timestamp, nonce = int(time.time()), fresh_nonce()
    mac = _mac(token, _request_message(method, target, timestamp, nonce))
    return f"{SCHEME} t={timestamp},n={nonce},s={mac}", nonce


def fresh_nonce() -> str:
    return secrets.token_hex(16)


def is_nonce(value: str) -> bool:
    return 0 < len(value) <= 64 and value.isascii() and value.isalnum()


def parse(value: str) -> Signature | None:
    """The signature in an Authorization header's value; None if it is not one."""
    scheme, _, rest = value.partition(" ")
    if scheme != SCHEME:
        return None
    fields = dict(part.partition("=")[::2] for part in rest.split(","))
    t, n, s = fields.get("t", ""), fields.get("n", ""), fields.get("s", "")
    if not (t.isascii() and t.isdigit() and is_nonce(n) and _is_mac(s)):
        return None
    return Signature(int(t), n, s)


def signed_by(token: str, signature: Signature, method: str, target: str) -> bool:
    """Whether `signature` is `token`'s for this call (in constant time)."""
    expected = _mac(token, _request_message(method, target, signature.timestamp, signature.nonce))
    return hmac.compare_digest(expected.encode(), signature.mac.encode())


def proof(token: str, nonce: str) -> str:
    """The worker's answer to a signed call with `nonce`: only a holder of `token` can make it."""
    return _mac(token, f"fleetrl worker\n{nonce}")


def proven(token: str, nonce: str, answer: str | None) -> bool:
    return _is_mac(answer) and hmac.compare_digest(proof(token, nonce).encode(), answer.encode())


# -- the same in a JSON body (Dynamo's RL routes pass their handlers the body alone) ----------

BODY_SIGNATURE_FIELD = "fleetrl_signature"
BODY_PROOF_FIELD = "fleetrl_proof"


def _body_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def signed_body(token: str, target: str, body: dict) -> tuple[dict, str]:
    """`body` for a POST to `target` (`/engine/<route>`), signed with `token` (target, time,
    nonce and the body itself); and the nonce that the answer's proof must be made of."""
    timestamp, nonce = int(time.time()), fresh_nonce()
    mac = _mac(token, _request_message("POST", target, timestamp, nonce) + "\n" + _body_digest(body))
    return {**body, BODY_SIGNATURE_FIELD: {"t": timestamp, "n": nonce, "s": mac}}, nonce


def body_signature(body: dict) -> tuple[Signature | None, dict]:
    """The signature a body carries (None if none, or not one), and the body without it."""
    rest = {k: v for k, v in body.items() if k != BODY_SIGNATURE_FIELD}
    fields = body.get(BODY_SIGNATURE_FIELD)
    if not isinstance(fields, dict):
        return None, rest
    t, n, s = fields.get("t"), fields.get("n"), fields.get("s")
    if not (isinstance(t, int) and isinstance(n, str) and is_nonce(n) and _is_mac(s)):
        return None, rest
    return Signature(t, n, s), rest


def body_signed_by(token: str, signature: Signature, target: str, body: dict) -> bool:
    """Whether `signature` is `token`'s for a POST to `target` with this body (without the signature)."""
    expected = _mac(token, _request_message("POST", target, signature.timestamp, signature.nonce) + "\n"
                    + _body_digest(body))
    return hmac.compare_digest(expected.encode(), signature.mac.encode())


class FreshCalls:
    """What a worker remembers of the signed calls it let in: each nonce for MAX_SKEW_S, so a
    call is let in once, and only within MAX_SKEW_S of its time."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, int] = OrderedDict()  # nonce -> its call's time, oldest first

    def admit(self, signature: Signature) -> bool:
        """Whether a call whose signature checked out is fresh; it is remembered if so."""
        now = int(time.time())
        while self._seen and next(iter(self._seen.values())) < now - MAX_SKEW_S:
            self._seen.popitem(last=False)
        if abs(now - signature.timestamp) > MAX_SKEW_S or signature.nonce in self._seen:
            return False
        self._seen[signature.nonce] = signature.timestamp
        return True
