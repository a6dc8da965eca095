"""ASGI middleware, loaded into each vLLM API server with `--middleware`, that requires the
run's bearer token on every route but the health probe.

vLLM's own `--api-key` guards only the data-plane prefixes (/v1, /inference, ...): the
admin routes that pause the engine or replace its weights (/pause, /update_weights,
/collective_rpc, ...) would stay open. This middleware guards all of them. The token comes
from the environment (`contract.ADMIN_TOKEN_ENV`) because vLLM instantiates middleware
classes without arguments.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from fleetrl.contract import ADMIN_TOKEN_ENV

OPEN_PATHS = ("/health", "/ping")


class AdminTokenMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        token = os.environ.get(ADMIN_TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"{ADMIN_TOKEN_ENV} is not set: refusing to serve without an admin token")
        self._digest = hashlib.sha256(token.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "fleetrl: missing or wrong admin token"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
