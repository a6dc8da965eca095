"""The fleet coordinator: which workers exist, which may take traffic, and the publish fence.

Neither vLLM nor Dynamo offers a fleet-wide atomic weight update, so the coordinator owns it:

    publish(v):  pause every live worker -> transfer -> every worker reports v and the
                 sender's checksum -> resume them all.

A worker that fails, times out or reports anything else is marked dead or stale and gets no
traffic until it has been refitted; the fleet never resumes with mixed versions. Requests
only go to READY workers, chosen here (least in-flight, or sticky per session), so a worker
that appears in discovery serves nothing before it holds the fleet's current version.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from fleetrl.errors import FleetrlError
from fleetrl.inference.http import SINGLE_TRY
from fleetrl.inference.provider import (ImpostorWorker, InferenceProvider, NamedTensors, PauseMode, SameServerAs,
                                        WeightTransport, WorkerHeldByAnotherRun)
from fleetrl.inference.types import (GenerateRequest, GenerateResponse, UnversionedTokens, WorkerInfo, WorkerRole,
                                     WorkerState)
from fleetrl.processes import stopping
from fleetrl.records import FenceEvent, FleetEvent, PublishReport, WorkerEvent
from fleetrl.versions import VersionSpan

# How many sessions keep their worker. A session is a rollout group (its turns and samples
# share a prompt prefix, so one worker's prefix cache serves them all) and lives for one step:
# the map forgets the least recently used session rather than grow for the whole run.
STICKY_SESSIONS = 4096
# A request that failed on a worker that is still healthy (a 5xx, a malformed answer) is sent
# again, to another worker where there is one, this many times before the error ends it.
TRANSIENT_RETRIES = 2
# A completion cut by abort-mode publishes is continued at most this many times: each
# continuation needs a publish to land inside it, so more means publishes are starving it.
MAX_CONTINUATIONS = 8
# A worker whose answers failed answers.py's checks this many times in a row (each answer with a
# bad sample; one without resets the count) is stale, served nothing until refitted and probed:
# a worker that keeps answering badly would otherwise lose a sample of every request it serves.
BAD_ANSWERS_BEFORE_STALE = 3
# Why a worker cannot be refitted between publishes of a CUDA trainer.
UNKEPT_WEIGHTS = "the trainer streamed them from its GPUs during their publish and keeps no copy"


class PublishError(FleetrlError):
    pass


@dataclass(frozen=True)
class AgreementProbe:
    """A token sequence and the trainer's logprobs of it under the weights being published.

    A checksum proves which bytes a worker received; only its own scoring of the probe proves
    the engine installed them as the trainer holds them (a reload that broke a tied embedding
    passed every checksum)."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class WeightSource:
    """Weights a joining or stale worker is refitted to, those of `version`: what the last
    publish sent, or, before any publish, the weights the run starts from where the workers are
    attached (`Fleet.start`).

    `named_tensors` is None when the weights were valid only during their publish (streamed
    from a CUDA trainer's shards, which keeps no copy): such a worker is refitted by the next
    publish, which includes every worker that is not dead."""

    transport: WeightTransport
    named_tensors: NamedTensors | None
    checksum: str
    probe: AgreementProbe | None
    version: int


class Fleet:
    def __init__(self, provider: InferenceProvider, pause_mode: PauseMode = "keep",
                 discovery_interval_s: float = 5.0, health_timeout_s: float = 10.0,
                 no_worker_timeout_s: float = 600.0, probe_tolerance: float = 0.1, max_restarts: int = 0,
                 claim_trusted_s: float | None = None, log=print,
                 on_event: Callable[[FleetEvent], None] = lambda event: None) -> None:
        """`claim_trusted_s`: how long after a call of this run was sent to a worker (which
        renews the run's claim on it, engine/worker_claim.py) the fleet counts on the worker being
        this run's (InferenceConfig.claim_trusted_s); None: the provider's calls claim nothing."""
        self.provider = provider
        self.pause_mode = pause_mode
        self.discovery_interval_s = discovery_interval_s
        self.health_timeout_s = health_timeout_s
        self.no_worker_timeout_s = no_worker_timeout_s
        self.probe_tolerance = probe_tolerance
        self.restarts_left = max_restarts  # over the whole run, all workers together
        self.claim_trusted_s = claim_trusted_s
        # Worker id -> when the last call of this run it answered was sent: its claim holds until
        # that + inference.claim_lease_s. Only workers the run holds are here (`_check_claims`).
        self._claimed: dict[str, float] = {}
        # Worker id -> how often this run's claim on it may have lapsed: a request whose worker's
        # count changed while it ran may hold another run's tokens (`_check_claimed`).
        self._lapses: Counter[str] = Counter()
        # Workers whose claim may have lapsed since they were last verified: another run may have
        # refitted them, so `_refit` checks what they hold, as at first sight.
        self._lapsed: set[str] = set()
        self._restarts: set[asyncio.Task] = set()
        # The ids replacements of dead workers came up under (a Dynamo replacement is a new
        # instance), until the fleet finds them alive: a fleet with no live worker waits for them.
        self._replacements: set[str] = set()
        # Workers dead since a listing missed them while they answered their health check: the
        # next round finds them listed again (and refits them) or replaces them.
        self._unlisted: set[str] = set()
        # Server instance -> the worker that announced it first: one server is one worker, however
        # many addresses reach it (two spellings of its URL, a relay on a dead worker's address).
        self._instance_owners: dict[str, str] = {}
        # Each worker's refits that score the agreement probe (a publish's or a discovery
        # round's), counted: a request's tokens can only come from those after its dispatch.
        self._refits: dict[str, int] = {}
        # (worker id, refit) -> the version that refit installed, and the verdict of its agreement
        # probe: None, it agreed; else why not. Pending from the worker's resume until it is
        # scored; a failed one is kept, since a request held across that refit may still come
        # back from it (even after a later refit at the same version agreed).
        self._verdicts: dict[tuple[str, int], tuple[int, asyncio.Future[str | None]]] = {}
        self.log = log
        # Told of every worker state change and publish fence (the run's events file, which
        # its timeline is drawn from): WorkerEvent and FenceEvent records.
        self.on_event = on_event
        self.transient_errors = 0  # requests sent again after a healthy worker failed them
        # Worker id -> its samples that failed answers.py's checks (dropped by the orchestrator).
        self.bad_answers: Counter[str] = Counter()
        # Worker id -> its answers in a row with a bad sample, up to BAD_ANSWERS_BEFORE_STALE.
        self._bad_in_a_row: Counter[str] = Counter()
        self.version = 0
        self.workers: dict[str, WorkerInfo] = {}
        self._source: WeightSource | None = None
        self._inflight: dict[str, int] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # session id -> worker id
        self._changed = asyncio.Condition()  # notified whenever routability may have changed
        self._fence = asyncio.Lock()  # held by publish and by refits
        self._discovery: asyncio.Task | None = None
        self._renewals: asyncio.Task | None = None
        self._unready_since: float | None = None  # since when requests wait with no worker ready

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def checksum(self) -> str | None:
        """fleetrl checksum of the weights of the fleet's version; None at the base model of
        workers the provider launched (they received none)."""
        return self._source.checksum if self._source else None

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
        if weights is None and not self.provider.launches_workers:
            raise FleetrlError(f"the {self.provider.name} fleet attaches to workers fleetrl did not launch: "
                               "it needs the run's base weights to check them against before labelling them v0")
        await self.provider.start()
        if weights is not None:
            self._source = await weights()
            self.version = self._source.version
        else:
            self.version = launched_version
        if self.claim_trusted_s is not None:  # from the first claim on: refits one by one may take long
            self._renewals = asyncio.create_task(self._renewal_loop())
        await self.refresh()
        if not self.routable_workers():
            raise FleetrlError("no inference worker became ready: " + self._describe_failures())
        self._discovery = asyncio.create_task(self._discovery_loop())

    async def close(self) -> None:
        self.restarts_left = 0  # a worker that dies as the fleet stops is not started again
        for task in [self._discovery, self._renewals, *self._restarts]:
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.provider.close()

    async def _discovery_loop(self) -> None:
        # In this task only: a round's refits try each admin call once (http.SINGLE_TRY), so a
        # worker that fails to answer holds a waiting publish back for one timeout, not for
        # admin_retries + 1 of them; it is refitted at a later round. Fleet.start's refits, which
        # no publish waits for, keep the retries (a worker a killed run left mid-publish drops
        # the connection after the failed update's cleanup, and the next call needs one).
        SINGLE_TRY.set(True)
        while True:
            await asyncio.sleep(self.discovery_interval_s)
            try:
                await self.refresh()
            except Exception as e:  # discovery trouble must not kill the run; it is reported
                self.log(f"fleetrl: discovery failed: {e}")

    async def _renewal_loop(self) -> None:
        """Renew the run's claim on every worker it holds (a health check, which claims it) every
        discovery_interval_s, apart from the discovery rounds: a listing that fails or is slow, or
        a refit holding the fence, stops those, and a claim that lapsed meanwhile lets another run
        take a worker this run still routes to. A worker whose check fails is left to discovery;
        here it only goes unrenewed (`_check_claims` then takes it out)."""
        while True:
            await asyncio.sleep(self.discovery_interval_s)
            held = [w for w in self.workers.values() if w.id in self._claimed]
            await asyncio.gather(*(self._health(w) for w in held), return_exceptions=True)
            self._check_claims()

    # -- discovery and refit ---------------------------------------------------------------

    def ready_workers(self) -> list[WorkerInfo]:
        """Workers at the fleet's version that this run still holds (`_check_claims` first)."""
        self._check_claims()
        return [w for w in self.workers.values() if w.state == WorkerState.READY]

    def routable_workers(self) -> list[WorkerInfo]:
        """Ready workers a request can be pinned to: not prefill workers, which only
        prefill the prompts of requests pinned to decode workers (see `_acquire`)."""
        return [w for w in self.ready_workers() if w.role != WorkerRole.PREFILL]

    def ready_prefill_workers(self) -> list[WorkerInfo]:
        """Ready prefill workers: the only ones a request's prompt may be prefilled on."""
        return [w for w in self.ready_workers() if w.role == WorkerRole.PREFILL]

    async def refresh(self) -> None:
        """Mark vanished workers dead; bring new, stale or returning ones to the fleet's version.

        The publish fence is taken only after the provider's discovery (an etcd read, say, with
        its own retries) has answered, and every check under it is bounded by health_timeout_s:
        a slow discovery round never holds a publish back."""
        discovered = {w.id: w for w in await self.provider.discover()}
        async with self._fence:
            await self._mark_unlisted(discovered)
            for worker_id, found in discovered.items():
                self._unlisted.discard(worker_id)
                known = self.workers.get(worker_id)
                if known is None or (known.state == WorkerState.DEAD and known.admin_url != found.admin_url):
                    self.workers[worker_id] = known = found  # new, or restarted elsewhere
                    self._replacements.discard(worker_id)  # found: it no longer holds a dead fleet's wait
                # A worker that does not answer (hung, or still starting) is not refitted now:
                # its admin calls would hold the fence for their whole timeouts.
                if known.state in (WorkerState.JOINING, WorkerState.STALE, WorkerState.DEAD) \
                        and await self._healthy(known):
                    await self._refit(known)
            await self._each(self.ready_workers(), self._check_health, {}, WorkerState.DEAD)
            await self._each(self.ready_workers(), self._check_version, {}, WorkerState.STALE)
        await self._notify()

    async def _mark_unlisted(self, listed: dict[str, WorkerInfo]) -> None:
        """Mark the workers this listing misses dead. One that still answers its health check is
        not replaced yet: a listing can miss a live worker for a moment (a Dynamo discovery entry
        refreshed late), and a replacement kills it. It is replaced if the next listing misses
        it too; if that one lists it, it is refitted like any returning worker."""
        for worker in [w for w in self.workers.values() if w.id in self._unlisted and w.id not in listed]:
            self._unlisted.discard(worker.id)
            worker.error = "gone from two discovery rounds in a row"
            self.log(f"fleetrl: worker {worker.id} is {worker.error}")
            self._restart_soon(worker)
        missing = [w for w in self.workers.values() if w.id not in listed and w.state != WorkerState.DEAD]
        await asyncio.gather(*(self._listing_missed(w) for w in missing))

    async def _listing_missed(self, worker: WorkerInfo) -> None:
        """A live worker this listing misses: dead, and restarted unless it answers its health
        check (`_mark_unlisted`); one another run holds now is stale, as in `_healthy`, and never
        restarted: killing it would take a worker from the run that holds it."""
        try:
            answers = await self._health(worker)
        except WorkerHeldByAnotherRun as e:
            self._mark(worker, WorkerState.STALE, str(e))
            return
        except (ImpostorWorker, SameServerAs):
            answers = False
        if answers:
            self._unlisted.add(worker.id)
            self._mark(worker, WorkerState.DEAD, "gone from discovery, though it answers its health check: "
                                                 "replaced if the next round does not list it either",
                       restart=False)
        else:
            self._mark(worker, WorkerState.DEAD, "gone from discovery")

    async def _health(self, worker: WorkerInfo) -> bool:
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

    def _claim_renewed(self, worker: WorkerInfo, sent: float) -> None:
        """A call of this run sent to the worker at `sent` was answered: the run's claim on it
        holds for inference.claim_lease_s from then (the worker counts the lease from the call's
        arrival, later still). A lapse before it is counted first: a renewal does not undo it."""
        if self.claim_trusted_s is not None:
            self._check_claims([worker])
            self._claimed[worker.id] = max(sent, self._claimed.get(worker.id, sent))

    def _check_claims(self, workers: list[WorkerInfo] | None = None) -> None:
        """A worker (of `workers`, default all) none of whose calls answered within
        `claim_trusted_s` of being sent may have been taken by another run, and refitted by it:
        its lapse is counted (the requests it serves meanwhile are not trained, `_check_claimed`),
        `_refit` checks what it holds before it serves again, and a ready one is stale: out of
        routing until a health check renews the claim (or is refused: another run holds it) and
        it has been verified. The claim of a worker this run no longer holds is not followed."""
        now = time.monotonic()
        for worker in self.workers.values() if workers is None else workers:
            sent = self._claimed.get(worker.id)
            if sent is None or now - sent <= self.claim_trusted_s:
                continue
            del self._claimed[worker.id]
            self._lapses[worker.id] += 1
            self._lapsed.add(worker.id)
            if worker.state == WorkerState.READY:
                self._mark(worker, WorkerState.STALE, f"no call of this run answered for {now - sent:.0f} s: its "
                                                      "claim may have lapsed (inference.claim_lease_s) and another "
                                                      "run may have refitted it; verified again before it serves")

    def _check_claimed(self, serving: list[WorkerInfo], response: GenerateResponse, dispatched: dict[str, int]) -> None:
        """A response from a worker whose claim may have lapsed since the request was dispatched
        (`dispatched`: `_lapses` then) may hold tokens of another run's weights: flagged, never
        trained."""
        self._check_claims(serving)
        for worker in serving:
            if self._lapses[worker.id] != dispatched[worker.id] and response.version_error is None:
                response.version_error = (f"worker {worker.id}'s claim may have lapsed while it served the request "
                                          "(another run may have refitted it): its tokens are not trained")

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

    async def _healthy(self, worker: WorkerInfo) -> bool:
        """Whether a worker out of routing may be refitted now. One that another run holds is
        refused with one line naming it and the other run, and stays out (stale, not dead: it is
        not this run's to restart) until that run lets it go."""
        try:
            return await self._health(worker)
        except ImpostorWorker:
            return False
        except (WorkerHeldByAnotherRun, SameServerAs) as e:
            self._mark(worker, WorkerState.STALE, str(e))
            return False

    async def _check_health(self, worker: WorkerInfo) -> None:
        if not await self._health(worker):
            raise FleetrlError(f"failed its health check (no healthy answer within {self.health_timeout_s:g} s)")

    async def _check_version(self, worker: WorkerInfo) -> None:
        """A worker restarted at the same address comes back with the base weights: it no
        longer reports the version it was verified at, so it is stale until refitted. Only an
        answer counts: a busy worker that is slow to answer passed its health check."""
        try:
            async with asyncio.timeout(self.health_timeout_s):  # not through the admin client's retries
                reported = await self.provider.admin(worker).version()
        except ImpostorWorker:
            raise  # not an answer that is missing: an answer from something else
        except (FleetrlError, TimeoutError):
            return
        if reported != worker.version:
            raise FleetrlError(f"reports version {reported} but was verified at v{worker.version} "
                               f"(restarted?); refitting it")

    async def _refit(self, worker: WorkerInfo) -> None:
        """Give one worker the fleet's current version before it takes any request."""
        admin = self.provider.admin(worker)
        # Seen for the first time, or after this run's claim on it may have lapsed (another run may
        # have refitted it meanwhile): what it holds is checked, and it is sent only what it lacks.
        first_sight = worker.state == WorkerState.JOINING or worker.id in self._lapsed
        if not first_sight and self._source is not None and self._source.named_tensors is None:
            # Nothing to send it: stale (out of routing) until the next publish includes it.
            self._mark(worker, WorkerState.STALE, f"refit to v{self.version} waits for the next publish: "
                                                  f"{UNKEPT_WEIGHTS}")
            return
        self._mark(worker, WorkerState.SYNCING)
        try:
            # A worker that cannot say what its ranks hold (Dynamo's own worker started as plain
            # `python -m dynamo.vllm`) could never be verified: it is refused here, at every round,
            # before it is paused or sent anything, rather than after a refit it then fails.
            await admin.weight_state()
            await admin.pause(self.pause_mode)
            if self._source is None:
                # The fleet's version is that of the model folder the provider's workers loaded at
                # launch (`start`'s launched_version): nothing was published since.
                if worker.id in self._lapsed:  # it must hold them still: no rank received anything since
                    await admin.verify_weights(None)
                await admin.set_version(self.version)
                reported = await admin.version()
                if reported != self.version:
                    raise FleetrlError(f"reports version {reported} after being set to v{self.version}")
            elif first_sight and (why := await self._unlike(worker, self.version, self._source.checksum)) is None:
                pass  # it holds them already (an attached worker at the base, say); the probe still decides
            elif self._source.named_tensors is None:
                raise FleetrlError(f"it {why}; it waits for the next publish: {UNKEPT_WEIGHTS}")
            else:
                sync = self.provider.weight_sync(worker)
                if first_sight:
                    self.log(f"fleetrl: worker {worker.id} {why}: refitting it with the weights of v{self.version}")
                    # A coordinator that died mid-publish (a run killed, then run again on the same
                    # attached workers) may have left an update open: the worker would refuse a new one.
                    await sync.abandon(self.version)
                checksum = await self._source.transport.transfer([sync], self._source.named_tensors, self.version)
                await self._verify(worker, self.version, checksum)
            probe = self._source.probe if self._source is not None else None
            if probe is not None:
                self._expect_verdicts([worker], self.version)
            await self._resume(worker)
            if probe is not None:
                await self._agrees(worker, probe, self.ready_prefill_workers())
        except Exception as e:
            self._settle_verdicts(self.version, set(), {worker.id: str(e)})
            self._mark(worker, WorkerState.STALE, f"refit to v{self.version} failed: {e}")
            return
        self._settle_verdicts(self.version, {worker.id}, {})
        worker.version = self.version
        self._mark(worker, WorkerState.READY)
        self.log(f"fleetrl: worker {worker.id} ready at v{self.version}")

    async def _resume(self, worker: WorkerInfo) -> None:
        """Resume the worker: the last call of its publish or refit, which renews this run's claim."""
        sent = time.monotonic()
        await self.provider.admin(worker).resume()
        self._claim_renewed(worker, sent)

    async def _unlike(self, worker: WorkerInfo, version: int, checksum: str) -> str | None:
        """How the weights the worker reports differ from `version`'s; None if they do not. A
        worker seen for the first time is only sent what it lacks."""
        admin = self.provider.admin(worker)
        reported = await admin.version()
        if reported is None:
            return f"holds no version of this run (another run's, or none), not v{version}"
        if reported != version:
            return f"reports version {reported}, not v{version}"
        try:
            await admin.verify_weights(checksum)
        except FleetrlError as e:
            return f"holds other weights than v{version} ({e})"
        return None

    async def _verify(self, worker: WorkerInfo, version: int, checksum: str) -> int:
        """The worker must report `version`, and every one of its ranks the sender's checksum.
        Returns the most tensor bytes one of its ranks received."""
        admin = self.provider.admin(worker)
        reported = await admin.version()
        if reported != version:
            raise FleetrlError(f"reports version {reported}, expected v{version}")
        return max((rank.received_bytes or 0 for rank in await admin.verify_weights(checksum)), default=0)

    def _expect_verdicts(self, workers: list[WorkerInfo], version: int) -> None:
        """Before `workers` resume at `version`: their tokens at it are trusted only once they
        have agreed (`_check_probed`)."""
        loop = asyncio.get_running_loop()
        for worker in workers:
            refit = self._refits[worker.id] = self._refits.get(worker.id, 0) + 1
            self._verdicts[(worker.id, refit)] = version, loop.create_future()

    def _settle_verdicts(self, version: int, agreed: set[str], failed: dict[str, str]) -> None:
        """Every verdict pending at `version`: agreed, or failed (why; a worker that never got as
        far as its probe fails too). Agreed ones are dropped: no token of theirs waits on them."""
        for key, (at, verdict) in list(self._verdicts.items()):
            worker_id, _ = key
            if at != version or verdict.done():
                continue
            if worker_id in agreed:
                verdict.set_result(None)
                del self._verdicts[key]
            else:
                verdict.set_result(failed.get(worker_id, "its publish failed before its probe"))

    def _refits_of(self, workers: list[WorkerInfo]) -> dict[str, int]:
        """How many refits each of `workers` has had: taken at a request's dispatch."""
        return {w.id: self._refits.get(w.id, 0) for w in workers}

    async def _check_probed(self, serving: list[WorkerInfo], response: GenerateResponse,
                            dispatched: dict[str, int]) -> None:
        """Tokens produced at a version whose agreement probe their worker (or its prefill
        worker) then failed were not made by the trainer's weights: the response is flagged,
        never trained. Only the refits after its dispatch (`dispatched`: `_refits_of` then) can
        have made its tokens: a worker dispatched to had agreed, and a failed refit is no
        concern of a request sent after a later one agreed. One that comes back while the probe
        is scored waits for its verdict: in keep mode a request held across a publish runs on
        as soon as its worker resumes."""
        versions = {span.version for span in response.spans}
        returned = self._refits_of(serving)
        for worker in serving:
            for refit in range(dispatched[worker.id] + 1, returned[worker.id] + 1):
                version, verdict = self._verdicts.get((worker.id, refit), (None, None))
                if version not in versions:
                    continue  # agreed (dropped), or it installed a version none of these tokens is of
                why = await asyncio.shield(verdict)
                if why is not None and response.version_error is None:
                    response.version_error = (f"worker {worker.id} failed the agreement probe at v{version} ({why}): "
                                              f"its tokens at v{version} are not trained")

    async def _agrees(self, worker: WorkerInfo, probe: AgreementProbe, prefills: list[WorkerInfo],
                      deltas: dict[str, float] | None = None) -> None:
        """The worker scores the probe; more than `probe_tolerance` from the trainer's logprobs
        raises. Prefill workers only prefill (their scoring is a decode worker's): they are
        held to the checksum alone, and score through one of them where the fleet has some."""
        if worker.role == WorkerRole.PREFILL:
            return
        served = await self.provider.prompt_logprobs(worker, probe.token_ids, prefills[0] if prefills else None)
        delta = max(abs(a - b) for a, b in zip(served, probe.logprobs, strict=True))
        if deltas is not None:
            deltas[worker.id] = delta
        if not delta <= self.probe_tolerance:  # a NaN disagrees too
            raise FleetrlError(f"agreement probe: logprobs differ from the trainer's by up to {delta:.3g} "
                               f"> inference.probe_tolerance = {self.probe_tolerance:g} (weights received but "
                               f"not installed as sent)")

    # -- publish ---------------------------------------------------------------------------

    async def publish(self, version: int, transport: WeightTransport, named_tensors: NamedTensors,
                      probe: AgreementProbe | None = None, keep: bool = True) -> PublishReport:
        """Fence: pause all -> transfer -> verify version + checksum on all -> resume all ->
        each scores the agreement probe (when given) before it takes traffic.

        `keep`: `named_tensors` stays valid after the publish, and refits workers that join or
        go stale before the next one; False where it is valid only during this call (a stream
        gathered from a CUDA trainer's shards).

        Workers that fail are excluded (dead or stale, with the reason in the report) and the
        others complete the publish; if none completes, PublishError and nothing resumes.
        """
        if version <= self.version:
            raise PublishError(f"publish v{version}: the fleet is already at v{self.version}")
        await self._until_a_worker_lives()
        started = time.monotonic()
        failed: dict[str, str] = {}
        done_s: dict[str, float] = {}  # worker id -> when, from the fence's start, it was verified (and probed)
        received: dict[str, int] = {}

        async def checked(worker: WorkerInfo, check: Awaitable[None]) -> None:
            await check
            done_s[worker.id] = time.monotonic() - started

        async def verify(worker: WorkerInfo, checksum: str) -> None:
            received[worker.id] = await self._verify(worker, version, checksum)

        async with self._fence:
            self.on_event(FenceEvent(phase="start", version=version))
            resumed: list[WorkerInfo] = []
            agreed: set[str] = set()  # scored the probe within tolerance
            try:
                targets = [w for w in self.workers.values() if w.state != WorkerState.DEAD]
                # One bounded health check first: a hung worker leaves the fence now, after one
                # timeout, instead of holding every step of the publish for its admin timeouts.
                targets = await self._each(targets, self._check_health, failed, WorkerState.DEAD)
                for worker in targets:
                    self._mark(worker, WorkerState.PAUSED)
                await self._notify()
                admin = self.provider.admin
                paused = await self._each(targets, lambda w: admin(w).pause(self.pause_mode), failed, WorkerState.DEAD)
                for worker in paused:
                    self._mark(worker, WorkerState.UPDATING)
                checksum, updated = await self._transfer(paused, transport, named_tensors, version, failed)
                verified = await self._each(updated, lambda w: checked(w, verify(w, checksum)), failed,
                                            WorkerState.STALE)
                if not verified:
                    raise PublishError(f"publish v{version} completed on no worker: {self._format(failed)}")
                # From here on only workers verified at `version` take traffic: stale ones stay paused.
                self.version = version
                self._source = WeightSource(transport, named_tensors if keep else None, checksum, probe, version)
                if probe is not None:
                    self._expect_verdicts(verified, version)
                resumed = await self._each(verified, self._resume, failed, WorkerState.DEAD)
                deltas: dict[str, float] = {}
                if probe is not None:  # still UPDATING here: a worker that disagrees never takes a new request
                    prefills = [w for w in resumed if w.role == WorkerRole.PREFILL]
                    agree = await self._each(resumed, lambda w: checked(w, self._agrees(w, probe, prefills, deltas)),
                                             failed, WorkerState.STALE)
                    resumed = [w for w in resumed if w in agree]
                    agreed = {w.id for w in resumed}
                for worker in resumed:
                    worker.version = version
                    self._mark(worker, WorkerState.READY)
            finally:
                self._settle_verdicts(version, agreed, failed)
                self.on_event(FenceEvent(phase="end", version=version, ready=sorted(w.id for w in resumed)))
        await self._notify()
        if failed:
            self.log(f"fleetrl: publish v{version} excluded {self._format(failed)}")
        return PublishReport(version=version, seconds=time.monotonic() - started, checksum=checksum,
                             ready=[w.id for w in resumed], failed=failed, probe=deltas,
                             worker_seconds={w.id: done_s[w.id] for w in resumed},
                             received_bytes={w.id: received[w.id] for w in resumed})

    async def _transfer(self, workers: list[WorkerInfo], transport: WeightTransport,
                        named_tensors: NamedTensors, version: int,
                        failed: dict[str, str]) -> tuple[str, list[WorkerInfo]]:
        """Transfer to `workers`; if some of them break it, drop those and retry once.

        The error does not reliably name the worker at fault: in a collective, a peer's death
        surfaces first as a survivor's "connection reset". So the workers that no longer pass
        a health check are the culprits; only when all are healthy is the named one dropped.
        """
        retried = False
        while True:
            if not workers:
                raise PublishError(f"publish v{version}: no live worker to publish to: {self._format(failed)}")
            try:
                checksum = await transport.transfer([self.provider.weight_sync(w) for w in workers], named_tensors,
                                                    version)
                return checksum, workers
            except Exception as e:
                culprits = [] if retried else await self._transfer_culprits(workers, e)
                if culprits:
                    retried = True
                    for worker in culprits:
                        failed[worker.id] = f"transfer of v{version} failed: {e}"
                        self._mark(worker, WorkerState.DEAD, failed[worker.id])
                    workers = [w for w in workers if w not in culprits]
                    continue
                for worker in workers:
                    failed[worker.id] = f"transfer of v{version} failed: {e}"
                    self._mark(worker, WorkerState.STALE, failed[worker.id])
                raise PublishError(f"publish v{version} failed: {self._format(failed)}") from e

    async def _transfer_culprits(self, workers: list[WorkerInfo], error: Exception) -> list[WorkerInfo]:
        health = await asyncio.gather(*(self._healthy(w) for w in workers))
        dead = [w for w, ok in zip(workers, health) if not ok]
        named = [w for w in workers if w.id == getattr(error, "worker_id", None)]
        return dead or named

    async def wait_for_version(self, version: int) -> None:
        """Return once the fleet serves `version` or newer (admission control waits here)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.version >= version)

    # -- data plane ------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> list[GenerateResponse]:
        """Sample `request.n` completions on a ready worker, with exact version spans.

        A completion cut short by an abort-mode publish is continued (prompt + partial output)
        on a ready worker once the publish is over, and its spans are joined.
        """
        responses = await self._generate_once(request, [])
        return [await self._continue_aborted(request, r) for r in responses]

    async def _generate_once(self, request: GenerateRequest, suffix: list[int]) -> list[GenerateResponse]:
        """One request on one ready worker. If that worker died under it, once more elsewhere
        (twice at most), so a single lost worker does not fail a rollout; if a healthy worker
        failed it (a 5xx, a malformed answer), again on another worker, TRANSIENT_RETRIES times."""
        deaths_left, transient_left = 2, TRANSIENT_RETRIES
        failed_on: set[str] = set()
        while True:
            worker, prefill = await self._acquire(request.session_id, avoid=failed_on)
            serving = [w for w in (worker, prefill) if w is not None]
            fleet_version = self.version
            refits = self._refits_of(serving)  # those after this dispatch may have made its tokens
            lapses = {w.id: self._lapses[w.id] for w in serving}
            try:
                responses = await self.provider.generate(worker, request, suffix, prefill)
                break
            except UnversionedTokens as e:
                # Restarted behind the fleet's back (its address, its base weights): stale until
                # the discovery loop refits it; the request waits for a ready worker meanwhile.
                bad = self.workers.get(e.worker_id, worker)
                self._mark(bad, WorkerState.STALE, str(e))
                await self._notify()
            except Exception as e:  # a malformed answer surfaces as KeyError, ValueError, ...
                dead = [w for w in serving if not await self._healthy(w)]
                if dead and deaths_left:
                    deaths_left -= 1
                    for w in dead:
                        self._mark(w, WorkerState.DEAD, f"died serving {request.request_id}: {e}")
                    await self._notify()
                elif not dead and transient_left:
                    transient_left -= 1
                    self.transient_errors += 1
                    failed_on.add(worker.id)
                    self.log(f"fleetrl: request {request.request_id} failed on healthy worker {worker.id} "
                             f"({type(e).__name__}: {str(e)[:200]}); sending it again")
                else:
                    raise
            finally:
                for w in serving:
                    self._inflight[w.id] -= 1
        if bad := [r for r in responses if r.answer_error is not None]:
            await self._answered_badly(worker, bad)
        else:
            self._bad_in_a_row.pop(worker.id, None)
        for response in responses:
            self._check_versions(worker, response, fleet_version)
            await self._check_probed(serving, response, refits)
            self._check_claimed(serving, response, lapses)
        return responses

    async def _answered_badly(self, worker: WorkerInfo, bad: list[GenerateResponse]) -> None:
        """Samples of the worker's answer failed their checks (inference/answers.py): they carry
        no tokens and the orchestrator drops them (`bad_answer`); the request is not sent again
        and the run goes on. They count against the worker like a failed request: counted and
        logged, and a worker that then fails its health check is dead; one that answered badly
        BAD_ANSWERS_BEFORE_STALE times in a row is stale until the discovery loop refits it."""
        self.bad_answers[worker.id] += len(bad)
        self._bad_in_a_row[worker.id] += 1
        self.log(f"fleetrl: {bad[0].answer_error}; {len(bad)} sample(s) dropped (bad_answer)")
        if worker.state != WorkerState.DEAD and not await self._healthy(worker):
            self._bad_in_a_row.pop(worker.id)
            self._mark(worker, WorkerState.DEAD, f"failed its health check after a bad answer: {bad[0].answer_error}")
            await self._notify()
        elif worker.state == WorkerState.READY and self._bad_in_a_row[worker.id] >= BAD_ANSWERS_BEFORE_STALE:
            self._bad_in_a_row.pop(worker.id)
            self._mark(worker, WorkerState.STALE, f"answered badly {BAD_ANSWERS_BEFORE_STALE} times in a row "
                                                  f"(the last: {bad[0].answer_error})")
            await self._notify()

    def _check_versions(self, worker: WorkerInfo, response: GenerateResponse, dispatched_at: int) -> None:
        """Second line of defence: the engine's spans must lie within what the fleet published
        while the request ran. A response outside is flagged (its sample must not be trained
        on) and the worker goes stale until the next discovery round refits it."""
        versions = {span.version for span in response.spans}
        if versions and (min(versions) < dispatched_at or max(versions) > self.version):
            response.version_error = (f"worker {worker.id} produced tokens at versions {sorted(versions)}, "
                                      f"outside the fleet's v{dispatched_at}..v{self.version}")
            if worker.state == WorkerState.READY:
                self._mark(worker, WorkerState.STALE, response.version_error)
                self.log(f"fleetrl: request {response.request_id}: {response.version_error}; worker stale")

    async def _continue_aborted(self, request: GenerateRequest, response: GenerateResponse) -> GenerateResponse:
        continuations = 0
        while response.finish_reason == "abort" and len(response.token_ids) < request.sampling.max_tokens:
            if continuations == MAX_CONTINUATIONS:
                raise FleetrlError(f"request {request.request_id} was cut by {continuations} publishes in a row "
                                   f"(at {len(response.token_ids)} tokens); publishes are starving it")
            continuations += 1
            continuation = GenerateRequest(
                prompt_token_ids=request.prompt_token_ids, sampling=request.sampling, n=1,
                session_id=request.session_id, request_id=f"{request.request_id}-{len(response.token_ids)}",
            )
            (rest,) = await self._generate_once(continuation, response.token_ids)
            response = join_completions(response, rest)
        return response

    async def _acquire(self, session_id: str | None,
                       avoid: set[str] = frozenset()) -> tuple[WorkerInfo, WorkerInfo | None]:
        """A ready worker to pin the request to (not one in `avoid` if another is ready), and,
        when the fleet has prefill workers, a ready prefill worker for its prompt: both chosen
        here, so that neither can be a worker that has not been brought to the fleet's version."""
        async with self._changed:
            while not (ready := self.routable_workers()) or not self._prefill_ready():
                self._check_some_worker_may_serve()
                try:
                    async with asyncio.timeout(self.discovery_interval_s):
                        await self._changed.wait()
                except TimeoutError:
                    pass  # look again: the run must not wait forever for workers that never return
            self._unready_since = None
            ready = [w for w in ready if w.id not in avoid] or ready
            worker = self.workers.get(self._sticky.get(session_id, ""))
            if worker is None or worker.state != WorkerState.READY or worker.id in avoid:
                worker = self._least_busy(ready)
            if session_id is not None:
                self._sticky[session_id] = worker.id
                self._sticky.move_to_end(session_id)
                if len(self._sticky) > STICKY_SESSIONS:
                    self._sticky.popitem(last=False)
            prefills = self.ready_prefill_workers()
            prefill = self._least_busy(prefills) if prefills else None
            for w in (worker, prefill):
                if w is not None:
                    self._inflight[w.id] = self._inflight.get(w.id, 0) + 1
            return worker, prefill

    def _check_some_worker_may_serve(self) -> None:
        """Raise when no worker can serve and none will soon: all are dead, or none has been
        ready, paused for a publish, or being refitted for `no_worker_timeout_s`."""
        decode = [w for w in self.workers.values() if w.role != WorkerRole.PREFILL]
        if all(w.state == WorkerState.DEAD for w in decode) and not self.restart_pending():
            raise FleetrlError("no live inference worker: " + self._describe_failures())
        in_transition = (WorkerState.PAUSED, WorkerState.UPDATING, WorkerState.SYNCING)
        if any(w.state in in_transition for w in self.workers.values()):
            self._unready_since = None  # a publish or a refit is under way
            return
        now = time.monotonic()
        self._unready_since = self._unready_since or now
        if now - self._unready_since > self.no_worker_timeout_s:
            raise FleetrlError(f"no inference worker has been ready for {self.no_worker_timeout_s:g} s "
                               f"(inference.no_worker_timeout_s): {self._describe_failures()}")

    def _prefill_ready(self) -> bool:
        """No prefill workers, or at least one ready (if all are dead, decode workers serve alone)."""
        prefills = [w for w in self.workers.values() if w.role == WorkerRole.PREFILL]
        return all(w.state == WorkerState.DEAD for w in prefills) or any(w.state == WorkerState.READY for w in prefills)

    def in_flight(self, worker_id: str) -> int:
        """Requests this coordinator has sent the worker that have not come back yet."""
        return self._inflight.get(worker_id, 0)

    def _least_busy(self, workers: list[WorkerInfo]) -> WorkerInfo:
        return min(workers, key=lambda w: self.in_flight(w.id))

    # -- helpers ---------------------------------------------------------------------------

    async def _each(self, workers: list[WorkerInfo], op: Callable[[WorkerInfo], Awaitable[object]],
                    failed: dict[str, str], state_on_error: WorkerState) -> list[WorkerInfo]:
        """Run `op` on every worker concurrently; the ones that raise are marked and left out."""
        results = await asyncio.gather(*(op(w) for w in workers), return_exceptions=True)
        ok = []
        for worker, result in zip(workers, results):
            if isinstance(result, Exception):
                failed[worker.id] = str(result)
                # One another run holds is stale, never dead: not this run's to restart (`_healthy`).
                held = isinstance(result, WorkerHeldByAnotherRun)
                self._mark(worker, WorkerState.STALE if held else state_on_error, str(result))
            else:
                ok.append(worker)
        return ok

    def _mark(self, worker: WorkerInfo, state: WorkerState, error: str | None = None, restart: bool = True) -> None:
        """Set the worker's state (and why); one that dies is started again (`_restart_soon`),
        unless `restart` is False."""
        if state in (WorkerState.DEAD, WorkerState.STALE) and worker.state != state:
            self.log(f"fleetrl: worker {worker.id} is {state.value}: {error}")
            if state == WorkerState.DEAD and restart:
                self._restart_soon(worker)
        if state != worker.state:
            self.on_event(WorkerEvent(worker=worker.id, role=worker.role.value, state=state.value,
                                       version=worker.version, error=error))
        if state != WorkerState.DEAD:
            self._replacements.discard(worker.id)
        if state == WorkerState.READY:  # verified at the fleet's version: refitted or published to
            self._lapsed.discard(worker.id)
        worker.state = state
        worker.error = error

    async def _until_a_worker_lives(self) -> None:
        """With every worker dead and one being started again (one worker, say), a publish
        waits for it, at most `no_worker_timeout_s`: outside the fence, under which the
        discovery loop brings it back at the fleet's version first."""
        deadline = time.monotonic() + self.no_worker_timeout_s
        async with self._changed:
            while (self.restart_pending() and all(w.state == WorkerState.DEAD for w in self.workers.values())
                   and time.monotonic() < deadline):
                try:
                    async with asyncio.timeout(self.discovery_interval_s):
                        await self._changed.wait()
                except TimeoutError:
                    pass

    def restart_pending(self) -> bool:
        """Whether a dead worker may soon serve again: one is being started again, a replacement
        that came up has not been found alive by discovery yet, or a worker a listing missed
        still answered (the next round lists it again or replaces it). While one may, a fleet
        with no live worker waits (bounded by `no_worker_timeout_s`); once none may, it fails."""
        return bool(self._restarts or self._unlisted) or any(
            (w := self.workers.get(worker_id)) is None or w.state == WorkerState.DEAD
            for worker_id in self._replacements)

    def _restart_soon(self, worker: WorkerInfo) -> None:
        """Start `_restart` of a dead worker, while the run's restart budget lasts."""
        if self.restarts_left > 0:
            task = asyncio.get_running_loop().create_task(self._restart(worker))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)

    async def _restart(self, worker: WorkerInfo) -> None:
        """A dead (or hung) launched worker is started again, and awaited until its replacement
        is up; the discovery loop refits the replacement once it answers its health check, and
        only then does it serve. A replacement that does not come up gives its restart back."""
        if self.restarts_left <= 0:
            return
        if stopping():  # it died because fleetrl is stopping it (a SIGTERM, say)
            self.log(f"fleetrl: worker {worker.id} not restarted: fleetrl is stopping")
            return
        self.restarts_left -= 1  # taken before the await: workers that die together cannot overspend it
        try:
            replacement = await self.provider.restart(worker)
        except FleetrlError as e:  # its replacement exited or never came up
            self.log(f"fleetrl: worker {worker.id} not restarted: {'fleetrl is stopping' if stopping() else e}")
            replacement = None
        if replacement is None:
            self.restarts_left += 1
            return
        found = self.workers.get(replacement)
        if found is None or found.state == WorkerState.DEAD:  # not refitted yet: awaited by a fleet with none alive
            self._replacements.add(replacement)
        serves = "it serves again" if replacement == worker.id else f"its replacement, {replacement}, serves"
        self.log(f"fleetrl: worker {worker.id} restarted ({self.restarts_left} restart(s) left, "
                 f"inference.max_restarts); {serves} once refitted")

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _describe_failures(self) -> str:
        return self._format({w.id: f"{w.state.value}: {w.error}" for w in self.workers.values()}) or "none discovered"

    @staticmethod
    def _format(failed: dict[str, str]) -> str:
        return "; ".join(f"{worker_id} ({why})" for worker_id, why in failed.items())


def join_completions(head: GenerateResponse, tail: GenerateResponse) -> GenerateResponse:
    """The completion `head` continued by `tail`: tokens, logprobs and shifted spans appended;
    a bad sample where the continuation's answer was one (nothing of the completion is kept)."""
    if tail.answer_error is not None:
        return replace(tail, request_id=head.request_id)
    offset = len(head.token_ids)
    spans = list(head.spans) if head.token_ids else []
    for span in tail.spans:
        if not spans or spans[-1].version != span.version:
            spans.append(VersionSpan(span.version, span.start + offset))
    joined = GenerateResponse(
        request_id=head.request_id,
        token_ids=head.token_ids + tail.token_ids,
        logprobs=head.logprobs + tail.logprobs,
        finish_reason=tail.finish_reason,
        worker_id=tail.worker_id if tail.worker_id == head.worker_id else f"{head.worker_id}+{tail.worker_id}",
        spans=spans,
        version_error=head.version_error or tail.version_error,
    )
    joined.check()
    return joined
