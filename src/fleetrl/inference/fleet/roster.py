"""The workers every part of the fleet coordinator shares, and the run's hold on them.

One `Roster` holds the workers the run knows, their states and the fleet's version. It marks a
worker's state (telling `on_event`, and `on_mark` of the lifecycle, which restarts the dead),
runs the bounded health check, pins each server instance to one worker, and keeps the run's
claims on its workers: a worker none of whose calls answered within `claim_trusted_s` may have
been taken by another run, so it leaves routing until it is verified again. The fence, routing
and lifecycle read and change workers only through it: none keeps a worker list of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from fleetrl.errors import FleetrlError
from fleetrl.inference.provider import ImpostorWorker, InferenceProvider, SameServerAs, WorkerHeldByAnotherRun
from fleetrl.inference.types import GenerateResponse, WorkerInfo, WorkerRole, WorkerState
from fleetrl.records import FleetEvent, WorkerEvent


class Roster:
    def __init__(self, provider: InferenceProvider, health_timeout_s: float, claim_trusted_s: float | None,
                 log: Callable[[str], None], on_event: Callable[[FleetEvent], None]) -> None:
        """`claim_trusted_s`: how long after a call of this run was sent to a worker (which
        renews the run's claim on it, engine/worker_claim.py) the fleet counts on the worker being
        this run's (InferenceConfig.claim_trusted_s); None: the provider's calls claim nothing."""
        self.provider = provider
        self.health_timeout_s = health_timeout_s
        self.claim_trusted_s = claim_trusted_s
        self.log = log
        # Told of every worker state change and publish fence (the run's events file, which
        # its timeline is drawn from): WorkerEvent and FenceEvent records.
        self.on_event = on_event
        # Told of every state about to be set (worker, state, restart): the lifecycle restarts
        # the dead from here, whichever part of the fleet saw them die.
        self.on_mark: Callable[[WorkerInfo, WorkerState, bool], None] = lambda worker, state, restart: None
        # The newest version published: what every ready worker holds after a fenced publish; in a
        # rolling one, ready workers its waves have not reached yet hold an older one.
        self.version = 0
        self.workers: dict[str, WorkerInfo] = {}
        self.changed = asyncio.Condition()  # notified whenever routability may have changed
        # Worker id -> when the last call of this run it answered was sent: its claim holds until
        # that + inference.claim_lease_s. Only workers the run holds are here (`check_claims`).
        self._claimed: dict[str, float] = {}
        # Worker id -> how often this run's claim on it may have lapsed: a request whose worker's
        # count changed while it ran may hold another run's tokens (`check_claimed`).
        self.lapses: Counter[str] = Counter()
        # Workers whose claim may have lapsed since they were last verified: another run may have
        # refitted them, so the fence's refit checks what they hold, as at first sight.
        self.lapsed: set[str] = set()
        # Server instance -> the worker that announced it first: one server is one worker, however
        # many addresses reach it (two spellings of its URL, a relay on a dead worker's address).
        self._instance_owners: dict[str, str] = {}

    # -- states ----------------------------------------------------------------------------

    def ready_workers(self) -> list[WorkerInfo]:
        """Workers verified at their version (the fleet's, or during a rolling publish one its
        waves have not replaced yet) that this run still holds (`check_claims` first)."""
        self.check_claims()
        return [w for w in self.workers.values() if w.state == WorkerState.READY]

    def routable_workers(self) -> list[WorkerInfo]:
        """Ready workers a request can be pinned to: not prefill workers, which only
        prefill the prompts of requests pinned to decode workers (see `Routing.acquire`)."""
        return [w for w in self.ready_workers() if w.role != WorkerRole.PREFILL]

    def ready_prefill_workers(self) -> list[WorkerInfo]:
        """Ready prefill workers: the only ones a request's prompt may be prefilled on."""
        return [w for w in self.ready_workers() if w.role == WorkerRole.PREFILL]

    def mark(self, worker: WorkerInfo, state: WorkerState, error: str | None = None, restart: bool = True) -> None:
        """Set the worker's state (and why); one that dies is started again (`on_mark`), unless
        `restart` is False."""
        if state in (WorkerState.DEAD, WorkerState.STALE) and worker.state != state:
            self.log(f"fleetrl: worker {worker.id} is {state.value}: {error}")
        self.on_mark(worker, state, restart)
        if state != worker.state:
            self.on_event(WorkerEvent(worker=worker.id, role=worker.role.value, state=state.value,
                                       version=worker.version, error=error))
        if state == WorkerState.READY:  # verified at the fleet's version: refitted or published to
            self.lapsed.discard(worker.id)
        worker.state = state
        worker.error = error

    async def each(self, workers: list[WorkerInfo], op: Callable[[WorkerInfo], Awaitable[object]],
                   failed: dict[str, str], state_on_error: WorkerState) -> list[WorkerInfo]:
        """Run `op` on every worker concurrently; the ones that raise are marked and left out."""
        results = await asyncio.gather(*(op(w) for w in workers), return_exceptions=True)
        ok = []
        for worker, result in zip(workers, results):
            # BaseException: a step cancelled under it (an inner task another party cancelled)
            # comes back as a CancelledError, which is no Exception, and is no pass either.
            if isinstance(result, BaseException):
                failed[worker.id] = str(result) or type(result).__name__
                # One another run holds is stale, never dead: not this run's to restart (`healthy`).
                held = isinstance(result, WorkerHeldByAnotherRun)
                self.mark(worker, WorkerState.STALE if held else state_on_error, failed[worker.id])
            else:
                ok.append(worker)
        return ok

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def describe_failures(self) -> str:
        return describe({w.id: f"{w.state.value}: {w.error}" for w in self.workers.values()}) or "none discovered"

    # -- health ----------------------------------------------------------------------------

    async def health(self, worker: WorkerInfo) -> bool:
        """Whether the worker answers its health check within `health_timeout_s`: a hung
        process (SIGSTOP, a wedged engine) keeps its socket open and never answers. Raises
        ImpostorWorker when what answers cannot prove it is the worker,
        WorkerHeldByAnotherRun when another run holds it (the health check claims it), and
        SameServerAs when it is another live worker's server (`_pin_instance`)."""
        # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation that
        # arrives as the call completes, and the discovery loop would then never stop.
        sent = time.monotonic()
        try:
            async with asyncio.timeout(self.health_timeout_s):
                healthy = await self.provider.admin(worker).health()
        except (ImpostorWorker, WorkerHeldByAnotherRun):
            raise
        except Exception:  # TimeoutError included
            return False
        if healthy:  # a proven answer: the instance it was signed for is that server's
            self._pin_instance(worker)
            self._claim_renewed(worker, sent)
        return healthy

    async def healthy(self, worker: WorkerInfo) -> bool:
        """Whether a worker out of routing may be refitted now. One that another run holds is
        refused with one line naming it and the other run, and stays out (stale, not dead: it is
        not this run's to restart) until that run lets it go."""
        try:
            return await self.health(worker)
        except ImpostorWorker:
            return False
        except (WorkerHeldByAnotherRun, SameServerAs) as e:
            self.mark(worker, WorkerState.STALE, str(e))
            return False

    async def check_health(self, worker: WorkerInfo) -> None:
        if not await self.health(worker):
            raise FleetrlError(f"failed its health check (no healthy answer within {self.health_timeout_s:g} s)")

    def _pin_instance(self, worker: WorkerInfo) -> None:
        """Pin the server instance the worker announced to it; SameServerAs if another live
        worker announced it first. Here, not in the provider's discovery: an instance is learnt
        by the worker's signed calls, and a worker's changes when its server restarts, or when
        what answers at its address becomes a relay to another worker."""
        instance = self.provider.admin(worker).instance
        if instance is None:
            return
        owner = self.workers.get(self._instance_owners.get(instance, ""))
        if owner is not None and owner.id != worker.id and owner.state != WorkerState.DEAD:
            raise SameServerAs(worker.id, owner.id)
        self._instance_owners[instance] = worker.id

    # -- claims ----------------------------------------------------------------------------

    def held(self) -> list[WorkerInfo]:
        """The workers this run holds a claim on: those the lifecycle renews."""
        return [w for w in self.workers.values() if w.id in self._claimed]

    async def resume(self, worker: WorkerInfo) -> None:
        """Resume the worker: the last call of its publish or refit, which renews this run's claim."""
        sent = time.monotonic()
        await self.provider.admin(worker).resume()
        self._claim_renewed(worker, sent)

    def _claim_renewed(self, worker: WorkerInfo, sent: float) -> None:
        """A call of this run sent to the worker at `sent` was answered: the run's claim on it
        holds for inference.claim_lease_s from then (the worker counts the lease from the call's
        arrival, later still). A lapse before it is counted first: a renewal does not undo it."""
        if self.claim_trusted_s is not None:
            self.check_claims([worker])
            self._claimed[worker.id] = max(sent, self._claimed.get(worker.id, sent))

    def check_claims(self, workers: list[WorkerInfo] | None = None) -> None:
        """A worker (of `workers`, default all) none of whose calls answered within
        `claim_trusted_s` of being sent may have been taken by another run, and refitted by it:
        its lapse is counted (the requests it serves meanwhile are not trained, `check_claimed`),
        the fence's refit checks what it holds before it serves again, and a ready one is stale:
        out of routing until a health check renews the claim (or is refused: another run holds
        it) and it has been verified. The claim of a worker this run no longer holds is not
        followed."""
        now = time.monotonic()
        for worker in self.workers.values() if workers is None else workers:
            sent = self._claimed.get(worker.id)
            if sent is None or now - sent <= self.claim_trusted_s:
                continue
            del self._claimed[worker.id]
            self.lapses[worker.id] += 1
            self.lapsed.add(worker.id)
            if worker.state == WorkerState.READY:
                self.mark(worker, WorkerState.STALE, f"no call of this run answered for {now - sent:.0f} s: its "
                                                     "claim may have lapsed (inference.claim_lease_s) and another "
                                                     "run may have refitted it; verified again before it serves")

    def check_claimed(self, serving: list[WorkerInfo], response: GenerateResponse, dispatched: dict[str, int]) -> None:
        """A response from a worker whose claim may have lapsed since the request was dispatched
        (`dispatched`: `lapses` then) may hold tokens of another run's weights: flagged, never
        trained."""
        self.check_claims(serving)
        for worker in serving:
            if self.lapses[worker.id] != dispatched[worker.id] and response.version_error is None:
                response.version_error = (f"worker {worker.id}'s claim may have lapsed while it served the request "
                                          "(another run may have refitted it): its tokens are not trained")


def describe(failed: dict[str, str]) -> str:
    """Workers and why each failed, on one line."""
    return "; ".join(f"{worker_id} ({why})" for worker_id, why in failed.items())
