"""The fleet coordinator: which workers exist, which may take traffic, and the publish fence.

`Fleet` is what the rest of fleetrl uses, and composes four parts that share one `Roster` of
workers (roster.py: states, health checks, the run's claims): the fence (fence.py: publish,
refit, probe verdicts), routing (routing.py: acquire, sticky sessions, retries, the checks of
every response) and the lifecycle (lifecycle.py: start, discovery rounds, restarts, close).
Each layer imports only those below it: roster, fence, lifecycle, routing, then this module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fleetrl.inference.fleet.fence import AgreementProbe, Fence, PublishError, PublishKind, PublishReport, WeightSource
from fleetrl.inference.fleet.lifecycle import Lifecycle
from fleetrl.inference.fleet.roster import Roster
from fleetrl.inference.fleet.routing import Routing
from fleetrl.inference.provider import InferenceProvider, NamedTensors, PauseMode, WeightTransport
from fleetrl.inference.types import GenerateRequest, GenerateResponse, WorkerInfo
from fleetrl.records import FleetEvent

__all__ = ["AgreementProbe", "Fleet", "PublishError", "PublishReport", "WeightSource"]


class _HeldBy:
    """An attribute of `Fleet` that one of its parts holds, read and set on that part: each
    setting and figure lives in one place (`fleet.pause_mode = "abort"` sets the fence's)."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, fleet: Fleet | None, owner: type | None = None):
        return self if fleet is None else getattr(getattr(fleet, self.part), self.name)

    def __set__(self, fleet: Fleet, value) -> None:
        setattr(getattr(fleet, self.part), self.name, value)


class Fleet:
    workers = _HeldBy("roster")  # worker id -> WorkerInfo
    version = _HeldBy("roster")  # the fleet's version: the newest published (see Roster.version)
    on_event = _HeldBy("roster")
    health_timeout_s = _HeldBy("roster")
    checksum = _HeldBy("fence")
    pause_mode = _HeldBy("fence")
    probe_tolerance = _HeldBy("fence")
    publish_kind = _HeldBy("fence")  # inference.publish: "fenced" or "rolling"
    wave_size = _HeldBy("fence")  # inference.publish_wave
    max_lag = _HeldBy("routing")
    restarts_left = _HeldBy("lifecycle")
    bad_answers = _HeldBy("routing")
    transient_errors = _HeldBy("routing")

    def __init__(self, provider: InferenceProvider, pause_mode: PauseMode = "keep",
                 discovery_interval_s: float = 5.0, health_timeout_s: float = 10.0,
                 no_worker_timeout_s: float = 600.0, probe_tolerance: float = 0.1, max_restarts: int = 0,
                 claim_trusted_s: float | None = None, log=print,
                 on_event: Callable[[FleetEvent], None] = lambda event: None, publish: PublishKind = "fenced",
                 publish_wave: int = 1, max_lag: int | None = None) -> None:
        """`claim_trusted_s`: see `Roster`; `max_lag`: see `Routing` (the run's
        orchestrator.max_off_policy_steps); the other settings are those of the part that uses
        them (InferenceConfig documents each)."""
        self.provider = provider
        self.roster = Roster(provider, health_timeout_s, claim_trusted_s, log, on_event)
        self.fence = Fence(self.roster, pause_mode, probe_tolerance, publish, publish_wave)
        self.lifecycle = Lifecycle(self.roster, self.fence, discovery_interval_s, no_worker_timeout_s, max_restarts)
        self.routing = Routing(self.roster, self.fence, self.lifecycle, max_lag)
        self.roster.on_mark = self.lifecycle.marked

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, weights: Callable[[], Awaitable[WeightSource]] | None = None,
                    launched_version: int = 0) -> None:
        """Start the provider and bring its workers to the run's first version before any takes
        traffic: v0, the base model, or the version of the checkpoint a run resumes from.

        Workers the provider launched from the run's model folder hold its weights by
        construction, and are labelled `launched_version`: 0, the base (a resumed run publishes
        the checkpoint's version to them next), or the version that folder is of (`fleetrl eval`
        of a run's checkpoint: its step). Attached
        ones were started by someone else: a previous run may have left them at vN, or they may
        serve another model. With `weights` (the weights the run starts from, their version and
        the trainer's logprobs of the probe under them, awaited from `weights()` once the
        provider has started: `fleetrl rl` waits off the event loop for its trainer to load them;
        `fleetrl inference` and `eval` load them on the loop's thread, the main one, as a model
        load must be), a worker is
        labelled at that version only once it reports it and its ranks report that checksum (one
        that does not is refitted with them: a worker the killed run left at the checkpoint's
        version is not), and it scores the probe like the trainer."""
        await self.lifecycle.start(weights, launched_version)

    async def close(self) -> None:
        await self.fence.close()
        await self.lifecycle.close()

    async def refresh(self) -> None:
        """One discovery round: see `Lifecycle.refresh`."""
        await self.lifecycle.refresh()

    def restart_pending(self) -> bool:
        """Whether a dead worker may soon serve again: see `Lifecycle.restart_pending`."""
        return self.lifecycle.restart_pending()

    # -- the fence -------------------------------------------------------------------------

    async def publish(self, version: int, transport: WeightTransport, named_tensors: NamedTensors,
                      probe: AgreementProbe | None = None, keep: bool = True,
                      everywhere: bool = False) -> PublishReport:
        """Publish `version` to every worker that is not dead, through the fence (`Fence.publish`);
        with every worker dead and one being started again, first wait for it. `everywhere`: a
        rolling publish returns only once its last wave is through (the last of a run, one to be
        evaluated); a fenced one always does."""
        if version <= self.version:
            raise PublishError(f"publish v{version}: the fleet is already at v{self.version}")
        await self.lifecycle.until_a_worker_lives()
        return await self.fence.publish(version, transport, named_tensors, probe, keep, everywhere)

    async def wait_for_version(self, version: int) -> None:
        await self.fence.wait_for_version(version)

    # -- routing ---------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        return await self.routing.generate(request)

    def in_flight(self, worker_id: str) -> int:
        return self.routing.in_flight(worker_id)

    # -- the workers -----------------------------------------------------------------------

    def ready_workers(self) -> list[WorkerInfo]:
        return self.roster.ready_workers()

    def routable_workers(self) -> list[WorkerInfo]:
        return self.roster.routable_workers()

    def ready_prefill_workers(self) -> list[WorkerInfo]:
        return self.roster.ready_prefill_workers()
