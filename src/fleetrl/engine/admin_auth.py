"""ASGI middleware, loaded into each vLLM API server with `--middleware`, that requires one of
the run's two bearer tokens on every route but the health probes.

- The **data token** opens sampling (`DATA_PATHS`): what the coordinator's data client, or
  anyone the run hands it to, needs to draw completions.
- The **admin token** opens every route: pause and resume, weight transfer, versions,
  `/collective_rpc`, and sampling too (its holder may already replace the weights, so
  sampling adds nothing it could not do). fleetrl itself never sends it: its admin calls are
  signed with it (fleetrl/admin_signature.py), and every answer to a signed call carries this
  server's proof that it holds the token too, so a process that took a dead worker's port
  learns nothing and is found out at the first call.

vLLM's own `--api-key` guards only the API prefixes (/v1, /inference, ...): the admin routes
that pause the engine or replace its weights (/pause, /update_weights, /collective_rpc, ...)
would stay open. The tokens come from the environment (`contract.ADMIN_TOKEN_ENV`,
`contract.DATA_TOKEN_ENV`) because vLLM instantiates middleware classes without arguments.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from fleetrl import admin_signature
from fleetrl.contract import (ADMIN_AUTHORITIES_ENV, ADMIN_TOKEN_ENV, CLAIM_LEASE_HEADER, CLAIM_PATH,
                              CLAIM_RUN_HEADER, DATA_TOKEN_ENV)
from fleetrl.engine.worker_claim import WorkerClaim
from fleetrl.versions import is_run_id

OPEN_PATHS = ("/health", "/ping")
# Sampling, and what a sampling client reads (the model list, tokenization); each path also
# covers the paths below it (/v1/responses/{id}). A route not listed — one a later vLLM adds
# under /v1, say — needs the admin token: the list fails closed.
DATA_PATHS = ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses",
              "/v1/models", "/tokenize", "/detokenize")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _token_from_env(name: str) -> str:
    token = os.environ.get(name, "")
    if not token:
        raise RuntimeError(f"{name} is not set: refusing to serve without the run's tokens "
                           f"({ADMIN_TOKEN_ENV} and {DATA_TOKEN_ENV})")
    return token


def _target(scope) -> str:
    """The request's path and query as the caller sent them (what a signature covers)."""
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return (path + (b"?" + query if query else b"")).decode("latin-1")


def is_data_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in DATA_PATHS)


class AdminTokenMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        self._admin_token = _token_from_env(ADMIN_TOKEN_ENV)
        self._admin = _digest(self._admin_token)
        self._data = _digest(_token_from_env(DATA_TOKEN_ENV))
        self._fresh = admin_signature.FreshCalls()  # the nonces of signed calls let in
        # The addresses callers may reach this server at besides its own port (a port-mapping
        # Service, say): host:port, comma-separated (docs/cluster.md).
        self._authorities = {a.strip() for a in os.environ.get(ADMIN_AUTHORITIES_ENV, "").split(",") if a.strip()}
        self.claim = WorkerClaim()  # which fleetrl run holds this worker (engine/worker_claim.py)

    @staticmethod
    def _header(scope, name: str) -> str | None:
        for key, value in scope.get("headers", ()):
            if key == name.encode():
                return value.decode("latin-1")
        return None

    def _own_authority(self, scope) -> str | None:
        """The authority (host:port) the caller addressed, if it is this server's own: its
        listening port, or one of ADMIN_AUTHORITIES_ENV. A call or a nonce relayed from another
        address (a process on a dead worker's port passing it on) names that address instead."""
        host = admin_signature.with_port(self._header(scope, "host") or "", scope.get("scheme", "http"))
        _, _, port = host.rpartition(":")
        server = scope.get("server") or (None, None)
        if host in self._authorities or (port.isascii() and port.isdigit() and int(port) == server[1]):
            return host
        return None

    def _admits(self, scope, signature: admin_signature.Signature, body: bytes) -> str | None:
        """The authority of a signed call that is the admin token's for this very call (this
        server's address, this body, this claim), fresh, and not one seen before; else None."""
        authority = self._own_authority(scope)
        if authority is None:
            return None
        call = admin_signature.SignedCall(scope["method"], _target(scope), authority, body,
                                          self._header(scope, CLAIM_RUN_HEADER) or "",
                                          self._header(scope, CLAIM_LEASE_HEADER) or "")
        if admin_signature.signed_by(self._admin_token, signature, call) and self._fresh.admit(signature):
            return authority
        return None

    async def _proven(self, scope, receive, send, proof: bytes) -> None:
        """The app's answer, with this server's `proof` in its headers. An error the app raises
        is answered here, proven, with its text: vLLM's handler of last resort answers from
        outside this middleware, and the caller would take that answer for an impostor's."""
        started = False

        async def send_with_proof(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (admin_signature.PROOF_HEADER.encode(), proof)]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_proof)
        except Exception as e:
            if started:
                raise
            body = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
            await send_with_proof({"type": "http.response.start", "status": 500,
                                   "headers": [(b"content-type", b"application/json")]})
            await send_with_proof({"type": "http.response.body", "body": body})

    def _run_claim(self, scope) -> tuple[str, float] | None:
        """The run a signed call names, and its lease; None for a call that only looks (no run)."""
        run, lease = self._header(scope, CLAIM_RUN_HEADER), self._header(scope, CLAIM_LEASE_HEADER)
        if run is None or not is_run_id(run):
            return None
        try:
            return run, min(max(float(lease or 0), 0.0), 7 * 86400.0)
        except ValueError:
            return None

    async def _signed_call(self, scope, receive, send, proof: bytes) -> None:
        """A signed call let in: within the claim of the run it names (engine/worker_claim.py),
        answered with this server's proof."""
        claim = self._run_claim(scope)
        if claim is None:
            return await self._proven(scope, receive, send, proof)
        run, lease_s = claim
        if scope["path"] == CLAIM_PATH and scope["method"] == "DELETE":
            self.claim.release(run)
            return await _answer(send, 200, {"released": run}, proof)
        holder = self.claim.begin(run, lease_s)
        if holder is not None:
            return await _answer(send, 409, {
                "error": f"fleetrl: this worker is held by run {holder} (its claim lapses "
                         f"{self.claim.lease_left_s():.0f} s after that run's last call)",
                "held_by": holder, "lease_left_s": self.claim.lease_left_s()}, proof)
        try:
            return await self._proven(scope, receive, send, proof)
        finally:
            self.claim.end(run, lease_s)

    def _proof(self, nonce: str, authority: str) -> bytes:
        return admin_signature.proof(self._admin_token, nonce, authority).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        authorization = self._header(scope, "authorization") or ""
        signature = admin_signature.parse(authorization) if scope["type"] == "http" else None
        if signature is not None:
            # The signature covers the body: read it whole, then hand the app the same bytes.
            body, receive = await _buffered(receive)
            if authority := self._admits(scope, signature, body):
                return await self._signed_call(scope, receive, send, self._proof(signature.nonce, authority))
        if scope["path"] in OPEN_PATHS:  # open to anyone; signed, the answer proved the server above
            return await self.app(scope, receive, send)
        data_path = is_data_path(scope["path"])
        scheme, _, token = authorization.partition(" ")
        if signature is None and scheme.lower() == "bearer":
            presented = _digest(token)
            # Both comparisons always run, in constant time: the answer's timing says nothing
            # about which token came close.
            admin, data = hmac.compare_digest(presented, self._admin), hmac.compare_digest(presented, self._data)
            if admin or (data and data_path):
                nonce, authority = self._header(scope, admin_signature.NONCE_HEADER), self._own_authority(scope)
                if nonce is not None and admin_signature.is_nonce(nonce) and authority is not None:
                    return await self._proven(scope, receive, send, self._proof(nonce, authority))
                return await self.app(scope, receive, send)  # no proof: a relayed nonce gets none
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        needed = "the data or the admin token" if data_path else "the admin token"
        await _answer(send, 401, {"error": f"fleetrl: this route needs {needed}"})


async def _buffered(receive):
    """The request's whole body, and a `receive` that hands the app the same messages again."""
    messages, body = [], b""
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body"):
            break

    async def replay():
        return messages.pop(0) if messages else await receive()
    return body, replay


async def _answer(send, status: int, body: dict, proof: bytes | None = None) -> None:
    """An answer of the middleware itself (proven, with `proof`)."""
    headers = [(b"content-type", b"application/json")]
    if proof is not None:
        headers.append((admin_signature.PROOF_HEADER.encode(), proof))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})
