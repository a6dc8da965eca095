"""ASGI middleware, loaded into each vLLM API server with `--middleware`, that requires one of
the run's two bearer tokens on every route but the health probes.

- The **data token** opens sampling (`DATA_PATHS`): what the coordinator's data client, or
  anyone the run hands it to, needs to draw completions.
- The **admin token** opens every route: pause and resume, weight transfer, versions,
  `/collective_rpc`, and sampling too (its holder may already replace the weights, so
  sampling adds nothing it could not do). fleetrl itself never sends it: its admin calls are
  signed with it (fleetrl/admin_signature.py), for this server's instance (a random name made
  as the middleware starts, announced at `contract.INSTANCE_PATH`), and every answer to a
  signed call carries this server's proof that it holds the token too, of that answer's very
  body, so a process that took a dead worker's port learns nothing and is found out at the
  first call, and a call captured before a restart opens nothing after it.

One middleware, one instance and one memory of nonces per process: a server with more than
one API process (vLLM's `--api-server-count`) would refuse fleetrl's calls at random as signed
for another instance, so fleetrl's launcher refuses that flag (config.VllmConfig).

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
from collections.abc import Callable

from fleetrl import admin_signature
from fleetrl.contract import (ADMIN_AUTHORITIES_ENV, ADMIN_TOKEN_ENV, CLAIM_LEASE_HEADER, CLAIM_PATH,
                              CLAIM_RUN_HEADER, DATA_TOKEN_ENV, INSTANCE_PATH, STALE_INSTANCE)
from fleetrl.engine.worker_claim import WorkerClaim, parse_claim

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


# The proof header's value for an answer's whole body.
Prove = Callable[[bytes], bytes]


class AdminTokenMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        self._admin_token = _token_from_env(ADMIN_TOKEN_ENV)
        self._admin = _digest(self._admin_token)
        self._data = _digest(_token_from_env(DATA_TOKEN_ENV))
        self.instance = admin_signature.fresh_nonce()  # this start of the server (INSTANCE_PATH)
        self._fresh = admin_signature.FreshCalls()  # the nonces of signed calls let in
        # The names callers may reach this server by besides its socket's address (a host name,
        # a port-mapping Service): host:port, comma-separated (docs/cluster.md).
        self._authorities = {a.strip().lower() for a in os.environ.get(ADMIN_AUTHORITIES_ENV, "").split(",")
                             if a.strip()}
        self.claim = WorkerClaim()  # which fleetrl run holds this worker (engine/worker_claim.py)

    @staticmethod
    def _header(scope, name: str) -> str | None:
        for key, value in scope.get("headers", ()):
            if key == name.encode():
                return value.decode("latin-1")
        return None

    def _own_names(self, scope) -> set[str]:
        """The authorities (host:port) that name this server: the address of the socket the
        call came in on, any loopback name of its port when that is loopback, and those listed
        in ADMIN_AUTHORITIES_ENV. Not any host with its port: every server of a cluster may
        listen on the same one (8000), and a relay from a dead worker's address to a live one
        must name another server."""
        host, port = scope.get("server") or (None, None)
        if host is None or port is None:
            return set(self._authorities)
        names = {f"[{host}]:{port}" if ":" in host else f"{host}:{port}"}
        if admin_signature.is_loopback(host):
            names |= {f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"}
        return names | self._authorities

    def _addressed(self, scope) -> str:
        """The authority (host:port) the caller addressed: its Host header, with the scheme's port."""
        return admin_signature.with_port(self._header(scope, "host") or "", scope.get("scheme", "http"))

    def _own_authority(self, scope) -> str | None:
        """The authority the caller addressed, if it names this server (`_own_names`)."""
        authority = self._addressed(scope)
        return authority if authority.lower() in self._own_names(scope) else None

    def _signed_call_of(self, scope, signature: admin_signature.Signature, body: bytes) -> bool:
        """Whether `signature` is the admin token's for this very call (the address it names,
        this body, this claim, the instance it names)."""
        call = admin_signature.SignedCall(scope["method"], _target(scope), self._addressed(scope), body,
                                          signature.instance, self._header(scope, CLAIM_RUN_HEADER) or "",
                                          self._header(scope, CLAIM_LEASE_HEADER) or "")
        return admin_signature.signed_by(self._admin_token, signature, call)

    async def _proven(self, scope, receive, send, prove: Prove) -> None:
        """The app's answer, held until it is whole, then sent with this server's proof of it
        (`prove(its body)`) in its headers. An error the app raises before its answer is whole
        is answered here, proven, with its text: vLLM's handler of last resort answers from
        outside this middleware, and the caller would take that answer for an impostor's."""
        start, chunks, sent = None, [], False

        async def hold(message):
            nonlocal start, sent
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    sent = True
                    await _send(send, start["status"], start.get("headers", ()), b"".join(chunks), prove)
            else:
                await send(message)

        try:
            await self.app(scope, receive, hold)
        except Exception as e:
            if sent:
                raise
            body = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
            await _send(send, 500, [(b"content-type", b"application/json")], body, prove)

    async def _signed_call(self, scope, receive, send, prove: Prove) -> None:
        """A signed call let in: within the claim of the run it names (engine/worker_claim.py),
        answered with this server's proof."""
        claim = parse_claim(self._header(scope, CLAIM_RUN_HEADER), self._header(scope, CLAIM_LEASE_HEADER))
        if claim is None:
            return await self._proven(scope, receive, send, prove)
        run, lease_s = claim
        if scope["path"] == CLAIM_PATH and scope["method"] == "DELETE":
            self.claim.release(run)
            return await _answer(send, 200, {"released": run}, prove)
        holder = self.claim.begin(run, lease_s)
        if holder is not None:
            return await _answer(send, 409, self.claim.refusal(holder), prove)
        try:
            return await self._proven(scope, receive, send, prove)
        finally:
            self.claim.end(run, lease_s)

    def _answer_proof(self, nonce: str, authority: str, instance: str) -> Prove:
        """A signed call's proof (`instance`: this server's), or a data request's (""): one
        mechanism, of the answer's very body."""
        return lambda body: admin_signature.answer_proof(self._admin_token, nonce, authority, instance, body).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and scope["path"] == INSTANCE_PATH:  # no secret: it opens nothing by itself
            return await _answer(send, 200, {"instance": self.instance})
        authorization = self._header(scope, "authorization") or ""
        signature = admin_signature.parse(authorization) if scope["type"] == "http" else None
        if signature is not None:
            # The signature covers the body: read it whole, then hand the app the same bytes.
            body, receive = await _buffered(receive)
            if self._signed_call_of(scope, signature, body):
                authority = self._own_authority(scope)
                if authority is None:  # the run's call for another server: relayed here, or a name not listed
                    return await _answer(send, 401, {"error": (
                        f"fleetrl: signed for {self._addressed(scope)}, which is not an address of this server "
                        f"({', '.join(sorted(self._own_names(scope)))}): list the addresses callers use in "
                        f"{ADMIN_AUTHORITIES_ENV}")})
                if signature.instance != self.instance:  # the run's call to this server's previous start
                    return await _answer(send, 401, {"error": STALE_INSTANCE})
                if self._fresh.admit(signature):
                    return await self._signed_call(scope, receive, send,
                                                   self._answer_proof(signature.nonce, authority, self.instance))
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
                    return await self._proven(scope, receive, send, self._answer_proof(nonce, authority, ""))
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


async def _answer(send, status: int, body: dict, prove: Prove | None = None) -> None:
    """An answer of the middleware itself (proven, with `prove`)."""
    await _send(send, status, [(b"content-type", b"application/json")], json.dumps(body).encode(), prove)


async def _send(send, status: int, headers, body: bytes, prove: Prove | None) -> None:
    """A whole answer, with the proof of its `body` in its headers when `prove` is given."""
    if prove is not None:
        headers = [*headers, (admin_signature.PROOF_HEADER.encode(), prove(body))]
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})
    await send({"type": "http.response.body", "body": body})
