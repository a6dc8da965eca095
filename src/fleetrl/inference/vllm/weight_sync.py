"""The weight-sync client of one native vLLM worker: vLLM's weight-transfer routes, into
fleetrl's `fleetrl` backend on every rank (engine/weight_receiver.py), over the admin routes
its control client uses (admin.py).

None of these calls is retried but the cleanup: each blocks in a collective or changes weights.
"""

from __future__ import annotations

from fleetrl.inference.http import ABANDON_TIMEOUT_S, abandon_weight_update
from fleetrl.inference.vllm.admin import VllmAdminRoutes
from fleetrl.versions import incomplete_label, version_label


class VllmWeightSync:
    def __init__(self, routes: VllmAdminRoutes) -> None:
        self.worker_id = routes.worker_id
        self.routes = routes

    async def close(self) -> None:
        await self.routes.close()

    async def membership(self, group_name: str) -> tuple[int, bool]:
        joined = await self.routes.collective_rpc("fleetrl_broadcast_group")
        return len(joined), all(name == group_name for name in joined)

    async def init(self, init_info: dict, timeout_s: float) -> None:
        await self.routes.call("POST", "/init_weight_transfer_engine", idempotent=False, timeout_s=timeout_s,
                               json={"init_info": init_info})

    async def start(self, timeout_s: float) -> None:
        await self.routes.call("POST", "/start_weight_update", idempotent=False, timeout_s=timeout_s)

    async def update(self, update_info: dict, timeout_s: float) -> None:
        await self.routes.call("POST", "/update_weights", idempotent=False, timeout_s=timeout_s,
                               json={"update_info": update_info})

    async def finish(self, version: int, timeout_s: float) -> None:
        await self.routes.call("POST", "/finish_weight_update", idempotent=False, timeout_s=timeout_s,
                               json={"weight_version": version_label(version, self.routes.run())})

    async def abandon(self, version: int) -> None:
        # Both calls may be retried: a repeated finish is refused, never applied twice. They
        # need it: vLLM drops the connection after a failed weight call, and the next request
        # on it can fail before reaching the server.
        await abandon_weight_update(
            lambda: self.routes.call("POST", "/finish_weight_update", idempotent=True, timeout_s=ABANDON_TIMEOUT_S),
            lambda: self.routes.call("POST", "/update_weight_version", idempotent=True, timeout_s=ABANDON_TIMEOUT_S,
                                     json={"new_version": incomplete_label(version, self.routes.run())}),
        )
