"""ASGI middleware, loaded into each vLLM API server with `--middleware`, that requires one of
the run's two bearer tokens on every route but the health probes.

- The **data token** opens sampling (`DATA_PATHS`): what the coordinator's data client, or
  anyone the run hands it to, needs to draw completions.
- The **admin token** opens every route: pause and resume, weight transfer, versions,
  `/collective_rpc`, and sampling too (its holder may already replace the weights, so
  sampling adds nothing it could not do).

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

from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV

OPEN_PATHS = ("/health", "/ping")
# Sampling, and what a sampling client reads (the model list, tokenization); each path also
# covers the paths below it (/v1/responses/{id}). A route not listed — one a later vLLM adds
# under /v1, say — needs the admin token: the list fails closed.
DATA_PATHS = ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses",
              "/v1/models", "/tokenize", "/detokenize")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _token_from_env(name: str) -> bytes:
    token = os.environ.get(name, "")
    if not token:
        raise RuntimeError(f"{name} is not set: refusing to serve without the run's tokens "
                           f"({ADMIN_TOKEN_ENV} and {DATA_TOKEN_ENV})")
    return _digest(token)


def is_data_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in DATA_PATHS)


class AdminTokenMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        self._admin = _token_from_env(ADMIN_TOKEN_ENV)
        self._data = _token_from_env(DATA_TOKEN_ENV)

    def _bearer(self, scope) -> bytes | None:
        """The digest of the request's bearer token; None without one."""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return _digest(token)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        data_path = is_data_path(scope["path"])
        presented = self._bearer(scope)
        if presented is not None:
            # Both comparisons always run, in constant time: the answer's timing says nothing
            # about which token came close.
            admin, data = hmac.compare_digest(presented, self._admin), hmac.compare_digest(presented, self._data)
            if admin or (data and data_path):
                return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        needed = "the data or the admin token" if data_path else "the admin token"
        body = json.dumps({"error": f"fleetrl: this route needs {needed}"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
