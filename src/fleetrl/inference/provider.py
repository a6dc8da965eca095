"""The seam between fleetrl and an inference stack.

The orchestrator and the fleet coordinator depend on these two protocols only. A provider
launches or attaches to a fleet, says which workers exist right now (discovery), sends
data-plane requests, and hands out one control-plane client per worker: admin calls always go
straight to the worker, never through a router.
"""

from __future__ import annotations

from typing import Literal, Protocol

from fleetrl.inference.types import GenerateRequest, GenerateResponse, WorkerInfo

PauseMode = Literal["keep", "abort", "wait"]


class WorkerAdmin(Protocol):
    """Control plane of one worker (all of its tensor-parallel ranks)."""

    worker_id: str

    async def health(self) -> bool: ...

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    async def version(self) -> int | None: ...

    async def set_version(self, version: int) -> None: ...

    async def collective_rpc(self, method: str, args: list | None = None) -> list:
        """Call an engine-side fleetrl method on every rank (e.g. fleetrl_weight_checksum)."""

    async def close(self) -> None: ...


class InferenceProvider(Protocol):
    name: str

    async def start(self) -> None:
        """Launch the fleet (or attach to an existing one) and wait until it answers."""

    async def discover(self) -> list[WorkerInfo]:
        """The workers that exist now, with stable ids; states are the coordinator's business."""

    async def generate(self, worker: WorkerInfo, request: GenerateRequest,
                       prompt_suffix: list[int] = ()) -> list[GenerateResponse]:
        """Send one request to `worker` (pinned, even where a router could choose)."""

    async def prompt_logprobs(self, worker: WorkerInfo, token_ids: list[int]) -> list[float]:
        """Score a token sequence on `worker`: log p(token_i | tokens_<i) for i >= 1."""

    def admin(self, worker: WorkerInfo) -> WorkerAdmin: ...

    async def close(self) -> None:
        """Close clients and stop every process the provider launched."""
