"""Control plane of one native vLLM worker: pause, resume, versions, weight transfer.

Every call goes straight to the worker (never through a router), carries the run's admin
token, has a timeout, and is retried a bounded number of times where that is safe: idempotent
calls on any transport error, the others only when the connection was never made.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from fleetrl.errors import FleetrlError
from fleetrl.inference.provider import ABANDON_TIMEOUT_S, PauseMode, WorkerCallError
from fleetrl.versions import incomplete_version_name, parse_version, version_name


class VllmAdminClient:
    def __init__(self, worker_id: str, url: str, token: str, timeout_s: float, retries: int) -> None:
        self.worker_id = worker_id
        self.url = url
        self.retries = retries
        self._http = httpx.AsyncClient(
            base_url=url, timeout=timeout_s, headers={"Authorization": f"Bearer {token}"}
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def call(self, method: str, path: str, *, idempotent: bool, timeout_s: float | None = None,
                   **kwargs: Any) -> Any:
        what = f"{method} {path}"
        for attempt in range(self.retries + 1):
            try:
                extra = {"timeout": timeout_s} if timeout_s is not None else {}
                response = await self._http.request(method, path, **kwargs, **extra)
            except httpx.ConnectError as e:
                error = f"cannot connect to {self.url} ({e})"
            except httpx.TransportError as e:
                if not idempotent:
                    raise WorkerCallError(self.worker_id, what, f"{type(e).__name__}: {e}") from None
                error = f"{type(e).__name__} talking to {self.url}"
            else:
                if response.status_code == 401:
                    raise WorkerCallError(self.worker_id, what, "the admin token was refused")
                if response.status_code >= 400:
                    raise WorkerCallError(self.worker_id, what, f"HTTP {response.status_code}: {response.text[:300]}")
                return response.json() if response.content else None
            if attempt < self.retries:
                await asyncio.sleep(0.5 * 2**attempt)
        raise WorkerCallError(self.worker_id, what, error)

    async def health(self) -> bool:
        try:
            response = await self._http.get("/health", timeout=5.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def pause(self, mode: PauseMode) -> None:
        # clear_cache: a prefix cache filled by old weights must not serve the new version.
        await self.call("POST", "/pause", idempotent=True, params={"mode": mode, "clear_cache": "true"})

    async def resume(self) -> None:
        await self.call("POST", "/resume", idempotent=True)

    async def is_paused(self) -> bool:
        return bool((await self.call("GET", "/is_paused", idempotent=True))["is_paused"])

    async def version(self) -> int | None:
        """The policy version the engine reports; None when it was never given a fleetrl version."""
        info = await self.call("GET", "/weight_info", idempotent=True)
        return parse_version(str(info["weight_version"]))

    async def set_version(self, version: int) -> None:
        await self.call("POST", "/update_weight_version", idempotent=True,
                        json={"new_version": version_name(version)})

    async def collective_rpc(self, method: str, args: list | None = None,
                             timeout_s: float | None = None, idempotent: bool = True) -> list:
        """Call a method of fleetrl's worker extension on every rank of this worker.

        fleetrl's engine methods only read state, so retrying is safe unless told otherwise.
        """
        body = {"method": method, "args": args or []}
        result = await self.call("POST", "/collective_rpc", idempotent=idempotent, json=body, timeout_s=timeout_s)
        return result["results"]

    async def verify_weights(self, checksum: str) -> None:
        sums = await self.collective_rpc("fleetrl_weight_checksum")
        if set(sums) != {checksum}:
            raise WorkerCallError(self.worker_id, "weight check",
                                  f"checksum {sorted(map(str, set(sums)))} != sender's {checksum}")

    # -- weight transfer: vLLM's protocol, into fleetrl's backend on every rank ---------------
    # None of these calls is retried: each blocks in a collective or changes weights.

    async def broadcast_membership(self, group_name: str) -> tuple[int, bool]:
        joined = await self.collective_rpc("fleetrl_broadcast_group")
        return len(joined), all(name == group_name for name in joined)

    async def init_weight_transfer(self, init_info: dict, timeout_s: float) -> None:
        await self.call("POST", "/init_weight_transfer_engine", idempotent=False, timeout_s=timeout_s,
                        json={"init_info": init_info})

    async def start_weight_update(self, timeout_s: float) -> None:
        await self.call("POST", "/start_weight_update", idempotent=False, timeout_s=timeout_s)

    async def update_weights(self, update_info: dict, timeout_s: float) -> None:
        await self.call("POST", "/update_weights", idempotent=False, timeout_s=timeout_s,
                        json={"update_info": update_info})

    async def finish_weight_update(self, version: int, timeout_s: float) -> None:
        await self.call("POST", "/finish_weight_update", idempotent=False, timeout_s=timeout_s,
                        json={"weight_version": version_name(version)})

    async def abandon_weight_update(self, version: int) -> None:
        # Both calls may be retried: a repeated finish is refused, never applied twice. They
        # need it: vLLM drops the connection after a failed weight call, and the next request
        # on it can fail before reaching the server.
        try:
            await self.call("POST", "/finish_weight_update", idempotent=True, timeout_s=ABANDON_TIMEOUT_S)
        except FleetrlError:
            pass  # no update open (the worker aborted it itself) or the worker is gone
        try:
            await self.call("POST", "/update_weight_version", idempotent=True, timeout_s=ABANDON_TIMEOUT_S,
                            json={"new_version": incomplete_version_name(version)})
        except FleetrlError:
            pass
