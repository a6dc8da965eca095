"""The weight-sync client of one Dynamo vLLM worker, over the RL routes its control client uses
(admin.py).

The worker runs with fleetrl's worker extension and `fleetrl` weight-transfer backend (engine
arguments Dynamo passes through to vLLM); the client names vLLM's own weight-transfer steps
through the routes' `engine_rpc`, so the engine side is the native provider's. Dynamo's routes
return none of the ranks' results, so the broadcast-group check runs the other way: the
expected name goes in, and a rank in another group raises, which the route reports as an error.

Start and finish move the worker's fence record, the one the control client moves and the
provider reads: the weights are in flux from start until finish labels them.
"""

from __future__ import annotations

from fleetrl.inference.dynamo.admin import DynamoAdminRoutes
from fleetrl.inference.http import ABANDON_TIMEOUT_S, abandon_weight_update
from fleetrl.inference.provider import WorkerCallError


class DynamoWeightSync:
    def __init__(self, routes: DynamoAdminRoutes) -> None:
        self.worker_id = routes.worker_id
        self.routes = routes

    async def close(self) -> None:
        await self.routes.close()

    async def membership(self, group_name: str) -> tuple[int, bool]:
        try:
            await self.routes.on_ranks("fleetrl_verify_broadcast_group", {"group_name": group_name}, reads_only=True)
        except WorkerCallError:
            return self.routes.world_size, False  # a rank not in it, or no answer: the sender re-forms
        return self.routes.world_size, True

    async def init(self, init_info: dict, timeout_s: float) -> None:
        await self.routes.call("init_weights_update_group",
                               {"engine_rpc": "init_weight_transfer_engine", "init_info": init_info},
                               timeout_s=timeout_s, retry=False)

    async def start(self, timeout_s: float) -> None:
        self.routes.fence = self.routes.fence.at_version(None)  # in flux until finished
        await self.routes.on_ranks("start_weight_update", {}, timeout_s)

    async def update(self, update_info: dict, timeout_s: float) -> None:
        await self.routes.on_ranks("update_weights", {"update_info": update_info}, timeout_s)

    async def finish(self, version: int, timeout_s: float) -> None:
        # One call closes the update, labels the worker and clears its prefix cache.
        await self.routes.call("update_weights_from_distributed",
                               {"engine_rpc": "finish_weight_update", "weight_version": self.routes.label(version)},
                               timeout_s=timeout_s, retry=False)
        self.routes.fence = self.routes.fence.at_version(version)

    async def abandon(self, version: int) -> None:
        await abandon_weight_update(
            lambda: self.routes.on_ranks("finish_weight_update", {}, ABANDON_TIMEOUT_S),
            lambda: self.routes.call("set_weight_version",
                                     {"weight_version": self.routes.label(version, incomplete=True)},
                                     timeout_s=ABANDON_TIMEOUT_S),
        )
