"""The admin routes of one native vLLM worker, and its control client: health, pause, resume,
versions, what its ranks hold. Its weight-sync client (weight_sync.py) shares the routes.

Every call goes straight to the worker (never through a router), is signed with the run's
admin token (the only one its admin routes take; the token itself is never sent), has a
timeout, and is retried a bounded number of times where that is safe: idempotent calls on any
transport error, the others only when the connection was never made.
"""

from __future__ import annotations

from typing import Any

from fleetrl.contract import WEIGHT_STATE_METHOD, RankWeights
from fleetrl.errors import FleetrlError
from fleetrl.inference.http import AdminHttp, RunClaim, check_rank_checksums, requests_in_engine
from fleetrl.inference.provider import PauseMode
from fleetrl.versions import parse_label, version_label


class VllmAdminRoutes:
    """One worker's admin endpoint (one connection pool), shared by its control and weight-sync
    clients, and the run they act for."""

    def __init__(self, worker_id: str, url: str, admin_token: str, timeout_s: float, retries: int,
                 claim: RunClaim | None) -> None:
        """`claim`: the run these clients label versions for and hold the worker for
        (engine/worker_claim.py); None for clients that only look (`fleetrl status`), which
        read any run's version and change nothing."""
        self.worker_id = worker_id
        self.claim = claim
        self.http = AdminHttp(worker_id, url, timeout_s, retries, admin_token, claim)

    def run(self) -> str:
        if self.claim is None:
            raise FleetrlError(f"worker {self.worker_id}: this admin client only looks; it labels nothing")
        return self.claim.run

    async def close(self) -> None:
        await self.http.close()

    async def call(self, method: str, path: str, *, idempotent: bool, timeout_s: float | None = None,
                   **kwargs: Any) -> Any:
        response = await self.http.call(method, path, idempotent=idempotent, timeout_s=timeout_s, **kwargs)
        return response.json() if response.content else None

    async def collective_rpc(self, method: str) -> list:
        """Call a method of fleetrl's worker extension on every rank of this worker; one
        result per rank. fleetrl's engine methods only read state, so the call is retried."""
        result = await self.call("POST", "/collective_rpc", idempotent=True, json={"method": method, "args": []})
        return result["results"]


class VllmWorkerControl:
    def __init__(self, routes: VllmAdminRoutes) -> None:
        self.worker_id = routes.worker_id
        self.routes = routes

    async def close(self) -> None:
        await self.routes.close()

    @property
    def instance(self) -> str | None:
        return self.routes.http.instance

    async def health(self) -> bool:
        """Signed: the server proves it is the one started with the run's token (a process that
        took a dead worker's port answers /health too)."""
        response = await self.routes.http.probe("GET", "/health", timeout_s=5.0, signed=True)
        return response is not None and response.status_code == 200

    async def pause(self, mode: PauseMode) -> None:
        # clear_cache: a prefix cache filled by old weights must not serve the new version.
        await self.routes.call("POST", "/pause", idempotent=True, params={"mode": mode, "clear_cache": "true"})

    async def resume(self) -> None:
        await self.routes.call("POST", "/resume", idempotent=True)

    async def is_paused(self) -> bool:
        return bool((await self.routes.call("GET", "/is_paused", idempotent=True))["is_paused"])

    async def version(self) -> int | None:
        """The policy version of this client's run that the engine reports; None when it holds
        none (never given one, an incomplete transfer's, or another run's)."""
        info = await self.routes.call("GET", "/weight_info", idempotent=True)
        label = parse_label(str(info["weight_version"]))
        if label is None or (self.routes.claim is not None and label.run != self.routes.claim.run):
            return None
        return label.version

    async def set_version(self, version: int) -> None:
        await self.routes.call("POST", "/update_weight_version", idempotent=True,
                               json={"new_version": version_label(version, self.routes.run())})

    async def weight_state(self) -> list[RankWeights]:
        return [RankWeights.from_result(self.worker_id, r)
                for r in await self.routes.collective_rpc(WEIGHT_STATE_METHOD)]

    async def verify_weights(self, checksum: str | None) -> list[RankWeights]:
        ranks = await self.weight_state()
        check_rank_checksums(self.worker_id, ranks, checksum)
        return ranks

    async def in_flight(self) -> int | None:
        response = await self.routes.http.call("GET", "/metrics", idempotent=True)
        return requests_in_engine(response.text)
