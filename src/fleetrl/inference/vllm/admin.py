"""Control plane of one native vLLM worker: pause, resume, versions, weight transfer.

Every call goes straight to the worker (never through a router), is signed with the run's
admin token (the only one its admin routes take; the token itself is never sent), has a
timeout, and is retried a bounded number of times where that is safe: idempotent calls on any
transport error, the others only when the connection was never made.
"""

from __future__ import annotations

from typing import Any

from fleetrl.contract import WEIGHT_STATE_METHOD
from fleetrl.errors import FleetrlError
from fleetrl.inference.http import (ABANDON_TIMEOUT_S, AdminHttp, RunClaim, abandon_weight_update,
                                    check_rank_checksums, requests_in_engine)
from fleetrl.inference.types import RankWeights
from fleetrl.inference.provider import PauseMode
from fleetrl.versions import incomplete_label, parse_label, version_label


class VllmAdminClient:
    def __init__(self, worker_id: str, url: str, admin_token: str, timeout_s: float, retries: int,
                 claim: RunClaim | None) -> None:
        """`claim`: the run this client labels versions for and holds the worker for
        (engine/worker_claim.py); None for a client that only looks (`fleetrl status`), which
        reads any run's version and changes nothing."""
        self.worker_id = worker_id
        self._claim = claim
        self._http = AdminHttp(worker_id, url, timeout_s, retries, admin_token, claim)

    def _run(self) -> str:
        if self._claim is None:
            raise FleetrlError(f"worker {self.worker_id}: this admin client only looks; it labels nothing")
        return self._claim.run

    async def close(self) -> None:
        await self._http.close()

    async def call(self, method: str, path: str, *, idempotent: bool, timeout_s: float | None = None,
                   **kwargs: Any) -> Any:
        response = await self._http.call(method, path, idempotent=idempotent, timeout_s=timeout_s, **kwargs)
        return response.json() if response.content else None

    async def health(self) -> bool:
        """Signed: the server proves it is the one started with the run's token (a process that
        took a dead worker's port answers /health too)."""
        response = await self._http.probe("GET", "/health", timeout_s=5.0, signed=True)
        return response is not None and response.status_code == 200

    async def pause(self, mode: PauseMode) -> None:
        # clear_cache: a prefix cache filled by old weights must not serve the new version.
        await self.call("POST", "/pause", idempotent=True, params={"mode": mode, "clear_cache": "true"})

    async def resume(self) -> None:
        await self.call("POST", "/resume", idempotent=True)

    async def is_paused(self) -> bool:
        return bool((await self.call("GET", "/is_paused", idempotent=True))["is_paused"])

    async def version(self) -> int | None:
        """The policy version of this client's run that the engine reports; None when it holds
        none (never given one, an incomplete transfer's, or another run's)."""
        info = await self.call("GET", "/weight_info", idempotent=True)
        label = parse_label(str(info["weight_version"]))
        if label is None or (self._claim is not None and label.run != self._claim.run):
            return None
        return label.version

    async def set_version(self, version: int) -> None:
        await self.call("POST", "/update_weight_version", idempotent=True,
                        json={"new_version": version_label(version, self._run())})

    async def collective_rpc(self, method: str) -> list:
        """Call a method of fleetrl's worker extension on every rank of this worker; one
        result per rank. fleetrl's engine methods only read state, so the call is retried."""
        result = await self.call("POST", "/collective_rpc", idempotent=True, json={"method": method, "args": []})
        return result["results"]

    async def weight_state(self) -> list[RankWeights]:
        return [RankWeights.from_result(self.worker_id, r) for r in await self.collective_rpc(WEIGHT_STATE_METHOD)]

    async def verify_weights(self, checksum: str | None) -> None:
        check_rank_checksums(self.worker_id, await self.weight_state(), checksum)

    async def in_flight(self) -> int | None:
        response = await self._http.call("GET", "/metrics", idempotent=True)
        return requests_in_engine(response.text)

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
                        json={"weight_version": version_label(version, self._run())})

    async def abandon_weight_update(self, version: int) -> None:
        # Both calls may be retried: a repeated finish is refused, never applied twice. They
        # need it: vLLM drops the connection after a failed weight call, and the next request
        # on it can fail before reaching the server.
        await abandon_weight_update(
            lambda: self.call("POST", "/finish_weight_update", idempotent=True, timeout_s=ABANDON_TIMEOUT_S),
            lambda: self.call("POST", "/update_weight_version", idempotent=True, timeout_s=ABANDON_TIMEOUT_S,
                              json={"new_version": incomplete_label(version, self._run())}),
        )
