"""Signed admin calls: fleetrl proves it holds the run's admin token without sending it, and the
worker proves the same in its answer (a leaf: imports nothing of fleetrl). A call carries an HMAC,
keyed by the token, of everything a relay or a replay could change (`SignedCall`), with a
timestamp and a fresh nonce; the answer carries a proof of the nonce, the authority, the instance
and its body (`answer_proof`); fleetrl's Dynamo worker kind carries both in the JSON body. The
threat and why each part is covered: docs/cluster.md, "Why admin calls are signed, and what the
signature covers"."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
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
    instance: str  # the server instance the call was signed for (as it announced it)
    mac: str


@dataclass(frozen=True)
class SignedCall:
    """What a signature covers. Both sides build it from the request as it travels: the
    caller from what it sends, the worker from what it receives."""

    method: str
    target: str  # path and query, as sent
    authority: str  # host:port the caller addressed (its Host header, with_port); "" where a worker cannot see it
    body: bytes
    instance: str  # the server instance the call is for (as the server announced it)
    run: str = ""  # the run's claim on the worker, as its headers name it (engine/worker_claim.py)
    lease: str = ""

    def message(self, timestamp: int, nonce: str) -> str:
        return "\n".join(["fleetrl request", self.method.upper(), self.target, self.authority,
                          hashlib.sha256(self.body).hexdigest(), self.instance, self.run, self.lease, str(timestamp),
                          nonce])


DEFAULT_PORTS = {"http": 80, "https": 443}


def with_port(host: str, scheme: str) -> str:
    """`host` (a Host header's value) with its port: a client leaves a scheme's default port out
    (`svc` for http://svc:80), and both sides of a signature must name the same address."""
    _, colon, port = host.rpartition(":")
    if colon and port.isascii() and port.isdigit():
        return host
    return f"{host}:{DEFAULT_PORTS.get(scheme, 80)}"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine's
    loopback (a name other than localhost may resolve to any interface, so it is not)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.lower().rstrip(".") == "localhost"
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def _is_mac(value: object) -> bool:
    """64 lowercase hex digits: what `_mac` makes (anything else is compared with nothing)."""
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX


def _mac(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def authorization(token: str, call: SignedCall) -> tuple[str, str]:
    """The Authorization header's value for `call`, and the nonce the answer's proof must be
    made of."""
    timestamp, nonce = int(time.time()), fresh_nonce()
    mac = _mac(token, call.message(timestamp, nonce))
    return f"{SCHEME} t={timestamp},n={nonce},i={call.instance},s={mac}", nonce


def fresh_nonce() -> str:
    """A random name: a call's nonce, or a server's instance (made once, as it starts)."""
    return secrets.token_hex(16)


def is_nonce(value: str) -> bool:
    return 0 < len(value) <= 64 and value.isascii() and value.isalnum()


def parse(value: str) -> Signature | None:
    """The signature in an Authorization header's value; None if it is not one."""
    scheme, _, rest = value.partition(" ")
    if scheme != SCHEME:
        return None
    fields = dict(part.partition("=")[::2] for part in rest.split(","))
    t, n, i, s = fields.get("t", ""), fields.get("n", ""), fields.get("i", ""), fields.get("s", "")
    if not (t.isascii() and t.isdigit() and is_nonce(n) and is_nonce(i) and _is_mac(s)):
        return None
    return Signature(int(t), n, i, s)


def signed_by(token: str, signature: Signature, call: SignedCall) -> bool:
    """Whether `signature` is `token`'s for this very call (in constant time)."""
    expected = _mac(token, call.message(signature.timestamp, signature.nonce))
    return hmac.compare_digest(expected.encode(), signature.mac.encode())


def answer_proof(token: str, nonce: str, authority: str, instance: str, body: bytes) -> str:
    """The worker's proof of its answer `body` to a call with `nonce` (a signed call's, or a data
    request's NONCE_HEADER) that reached its `instance` ("" for a data request, which names none)
    at `authority`: only a holder of `token` can make it, it holds for that address, that start
    of the server and those very bytes alone."""
    return _mac(token, "\n".join(["fleetrl answer", authority, instance, nonce, hashlib.sha256(body).hexdigest()]))


def proves(expected: str, answer: str | None) -> bool:
    """Whether a proof that came back (`answer`) is the `expected` one (in constant time)."""
    return _is_mac(answer) and hmac.compare_digest(expected.encode(), answer.encode())


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


# -- the same in a JSON body (Dynamo's RL routes pass their handlers the body alone) ----------

BODY_SIGNATURE_FIELD = "fleetrl_signature"
BODY_PROOF_FIELD = "fleetrl_proof"
BODY_INSTANCE_FIELD = "fleetrl_instance"  # where the liveness probe's answer announces the worker's instance


def canonical(body: dict) -> bytes:
    """The bytes a JSON body stands for on both sides (its serialization on the wire is the
    server's own: Dynamo's system server writes the handler's answer)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _body_call(target: str, body: dict, instance: str) -> SignedCall:
    return SignedCall("POST", target, "", canonical(body), instance)


def signed_body(token: str, target: str, body: dict, instance: str) -> tuple[dict, str]:
    """`body` for a POST to `target` (`/engine/<route>`) of the worker `instance`, signed with
    `token` (target, instance, time, nonce and the body itself); and the nonce that the answer's
    proof must be made of."""
    timestamp, nonce = int(time.time()), fresh_nonce()
    mac = _mac(token, _body_call(target, body, instance).message(timestamp, nonce))
    return {**body, BODY_SIGNATURE_FIELD: {"t": timestamp, "n": nonce, "i": instance, "s": mac}}, nonce


def body_signature(body: dict) -> tuple[Signature | None, dict]:
    """The signature a body carries (None if none, or not one), and the body without it."""
    rest = {k: v for k, v in body.items() if k != BODY_SIGNATURE_FIELD}
    fields = body.get(BODY_SIGNATURE_FIELD)
    if not isinstance(fields, dict):
        return None, rest
    t, n, i, s = fields.get("t"), fields.get("n"), fields.get("i"), fields.get("s")
    if not (isinstance(t, int) and isinstance(n, str) and is_nonce(n) and isinstance(i, str) and is_nonce(i)
            and _is_mac(s)):
        return None, rest
    return Signature(t, n, i, s), rest


def body_signed_by(token: str, signature: Signature, target: str, body: dict) -> bool:
    """Whether `signature` is `token`'s for a POST to `target` with this body (without the
    signature), for the instance it names."""
    return signed_by(token, signature, _body_call(target, body, signature.instance))


def body_proof(token: str, nonce: str, instance: str, answer: dict) -> str:
    """A Dynamo worker's proof of its `answer` (without the proof) to a signed call with `nonce`."""
    return answer_proof(token, nonce, "", instance, canonical(answer))
