"""The seam between fleetrl and an inference stack.

The orchestrator and the fleet coordinator depend on these protocols only. A provider
launches or attaches to a fleet, says which workers exist right now (discovery), sends
data-plane requests, and hands out two control-plane clients per worker: its control (health,
pause, versions, what its ranks hold) and its weight sync (the worker side of a transfer).
Admin calls always go straight to the worker, never through a router. A weight transport
(fleetrl.weights) moves a policy version onto paused workers through their weight-sync clients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from fleetrl.config import PauseMode
from fleetrl.contract import RankWeights
from fleetrl.errors import FleetrlError
from fleetrl.inference.types import GenerateRequest, GenerateResponse, WorkerInfo

if TYPE_CHECKING:
    import torch

# Called once per transfer; yields every full (unsharded) tensor of the policy, in a stable
# order, under the names the model's checkpoint uses. For a sharded trainer the iteration
# may be a collective (FSDP full_tensor()).
NamedTensors = Callable[[], Iterable[tuple[str, "torch.Tensor"]]]


class WorkerCallError(FleetrlError):
    """A failed admin call; names the worker (the coordinator reads `worker_id`)."""

    def __init__(self, worker_id: str, what: str, detail: str) -> None:
        super().__init__(f"worker {worker_id}: {what} failed: {detail}")
        self.worker_id = worker_id


class ImpostorWorker(WorkerCallError):
    """What answered at a worker's address could not prove it holds the run's admin token: not
    the server fleetrl started or attached to (fleetrl/admin_signature.py). Nothing it says is
    trusted; the fleet takes it for dead."""


class SameServerAs(WorkerCallError):
    """The worker announces the server instance another live worker of the fleet announced
    first (fleetrl/admin_signature.py): it is that server under another address (two spellings
    of one URL) or something relaying to it. The fleet keeps it out."""

    def __init__(self, worker_id: str, other: str) -> None:
        super().__init__(worker_id, "its health check", f"it announces the server instance of worker {other}: "
                                                        "the same server under another address, or a relay to it")


class WorkerHeldByAnotherRun(WorkerCallError):
    """The worker is another fleetrl run's (its claim, engine/worker_claim.py, is live): this run
    must not publish into it, nor train on what it samples. The fleet keeps it out: stale, not
    dead, since it is not this run's to restart."""

    def __init__(self, worker_id: str, what: str, holder: str, lease_left_s: float) -> None:
        super().__init__(worker_id, what, f"held by another fleetrl run, {holder} (its claim lapses "
                                          f"{lease_left_s:.0f} s after that run's last call; "
                                          "inference.claim_lease_s)")
        self.holder = holder


class WorkerControl(Protocol):
    """Control plane of one worker (all of its tensor-parallel ranks)."""

    worker_id: str

    @property
    def instance(self) -> str | None:
        """The server instance the worker last announced (admin_signature.py); None before it
        was asked, or where it announces none (Dynamo's own worker kind)."""

    async def health(self) -> bool: ...

    async def is_paused(self) -> bool:
        """Whether the worker is paused (by anyone: this client, or another coordinator)."""

    async def pause(self, mode: PauseMode) -> None: ...

    async def resume(self) -> None: ...

    async def version(self) -> int | None: ...

    async def set_version(self, version: int) -> None: ...

    async def weight_state(self) -> list[RankWeights]:
        """What each rank holds: its checksum, when it last received weights, whether an update is open."""

    async def verify_weights(self, checksum: str | None) -> list[RankWeights]:
        """Raise unless every rank holds weights whose fleetrl checksum is `checksum`; None: the
        weights it was launched with (no rank has received any since). Returns what each rank
        reported."""

    async def in_flight(self) -> int | None:
        """Requests the engine is running or has queued (vLLM's own gauges); None: it does not say."""

    async def close(self) -> None: ...


class WeightSyncClient(Protocol):
    """The worker side of a weight transfer (fleetrl's `fleetrl` weight-transfer backend in
    every rank of one worker), driven by a WeightTransport on a paused worker. The infos are
    the wire records' dicts (fleetrl.weights.wire), passed through unread."""

    worker_id: str

    async def membership(self, group_name: str) -> tuple[int, bool]:
        """(ranks of this worker, whether all of them are in broadcast group `group_name`)."""

    async def init(self, init_info: dict, timeout_s: float) -> None: ...

    async def start(self, timeout_s: float) -> None: ...

    async def update(self, update_info: dict, timeout_s: float) -> None: ...

    async def finish(self, version: int, timeout_s: float) -> None:
        """Close the update and label the worker `version`."""

    async def abandon(self, version: int) -> None:
        """After a failed transfer (best effort): close any open update and label the worker
        with a name that is no policy version, so its half-updated weights pass for none."""

    async def close(self) -> None: ...


class WeightTransport(Protocol):
    """Runs the weight part of publish(v) on workers the coordinator has already paused:
    (init if needed) -> start -> update ... -> finish(v).

    Returns fleetrl's checksum of what it sent; the coordinator then has every worker check
    that each of its ranks received exactly that. If a transfer fails, no worker is left with
    an update open, every worker of the call is labelled `incomplete-v{version}` (a label
    that names no policy version), and the error names a worker.
    """

    name: str

    async def transfer(self, workers: Sequence[WeightSyncClient], named_tensors: NamedTensors,
                       version: int) -> str:
        """Moves the weights onto already-paused workers as policy `version`; returns the
        sender-side checksum."""
        ...

    async def close(self) -> None: ...


class InferenceProvider(Protocol):
    name: str
    # True when the provider starts its workers itself, from the run's model folder: they hold
    # the base weights at v0 by construction. Attached workers (started by someone else) are
    # held to the base weights' checksum before they take traffic (Fleet.start).
    launches_workers: bool

    async def start(self) -> None:
        """Launch the fleet (or attach to an existing one) and wait until it answers."""

    async def discover(self) -> list[WorkerInfo]:
        """The workers that exist now, with stable ids; states are the coordinator's business."""

    async def generate(self, worker: WorkerInfo, request: GenerateRequest, prompt_suffix: list[int] = (),
                       prefill: WorkerInfo | None = None) -> list[GenerateResponse]:
        """Send one request to `worker` (pinned, even where a router could choose), its prompt
        prefilled by `prefill` when the fleet has prefill workers (disaggregated serving)."""

    async def prompt_logprobs(self, worker: WorkerInfo, token_ids: list[int],
                              prefill: WorkerInfo | None = None) -> list[float]:
        """Score a token sequence on `worker`: log p(token_i | tokens_<i) for i >= 1 (through
        `prefill` where the deployment routes every request through a prefill worker)."""

    def admin(self, worker: WorkerInfo) -> WorkerControl: ...

    def weight_sync(self, worker: WorkerInfo) -> WeightSyncClient:
        """The worker's weight-sync client: beside its control client, over the same connection."""

    async def restart(self, worker: WorkerInfo) -> str | None:
        """Start a worker this provider launched again, after it died or hung, and return once
        the replacement is up: the id discovery lists it under (the same id, or a new one where
        a new process is a new worker). None when it cannot (an attached worker); a
        FleetrlError when the replacement exits or is not up within startup_timeout_s. The
        coordinator refits it before it serves."""

    def attach_settings(self) -> dict:
        """The `[inference]` settings with which `fleetrl status` attaches to this running fleet,
        its tokens included (the run writes them apart, to RUN_DIR/tokens.json, mode 0600)."""

    async def close(self) -> None:
        """Close clients and stop every process the provider launched."""
