"""The publish fence: weights onto a set of workers, verified, before any of them serves them.

Neither vLLM nor Dynamo offers a fleet-wide atomic weight update, so the fence owns it:

    publish(v):  pause the workers -> transfer -> every worker reports v and the sender's
                 checksum -> resume them -> each scores the agreement probe.

A worker that fails, times out or reports anything else is marked dead or stale and gets no
traffic until it has been refitted. The same fence refits one worker that joins or went stale
(`refit`) from the weights of the last publish (`source`), and keeps each refit's probe verdict,
which decides whether tokens a request got across it are trained (`check_probed`).

A fenced publish (`inference.publish = "fenced"`) fences every live worker at once. A rolling
one fences them in waves of `wave_size`, oldest version first, while the others keep serving the
version they hold (each token carries it). The first wave is the canary: until one of its workers
has agreed at the version, no other wave takes it. Each wave gives a worker that failed (stale,
not dead) one more try, then leaves it stale, quarantined as in a fenced publish. The publish
returns once the canary has agreed; the other waves go on in the background, one at a time, each
under the lock (discovery rounds take turns with them). A new publish waits for the wave under
way and supersedes the rest: a worker that had not taken the older version takes the newer one
directly. A publish whose weights are not kept past the call, and one asked to reach `everywhere`
(the last of a run, one evaluated), returns only once every wave has taken it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Literal

from fleetrl import failpoints
from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet.roster import Roster, describe
from fleetrl.inference.provider import NamedTensors, PauseMode, WeightTransport
from fleetrl.inference.types import GenerateResponse, WorkerInfo, WorkerRole, WorkerState
from fleetrl.records import FenceEvent, PublishReport, WaveReport

PublishKind = Literal["fenced", "rolling"]

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


@dataclass(frozen=True)
class Wave:
    """Workers a rolling publish fences together: its number and whether it is the canary."""

    number: int
    canary: bool
    workers: list[WorkerInfo]


def plan_waves(workers: list[WorkerInfo], size: int) -> list[list[WorkerInfo]]:
    """`workers` in waves of `size` decode (or aggregated) workers, those furthest behind first
    (a worker with no version first of all), so the fleet's spread of versions stays small; stale
    ones last, so that a worker failing its refits is not the canary of every publish.
    Prefill workers are shared out over the waves, at least one each (so fewer waves where the
    fleet has fewer prefill workers than waves): a decode worker only takes prompts prefilled at
    its own version (`Routing`), and each wave can serve as soon as it is through. No workers,
    no wave."""
    def behind(worker: WorkerInfo) -> tuple[bool, int, str]:
        return worker.state == WorkerState.STALE, (-1 if worker.version is None else worker.version), worker.id

    if not workers:
        return []
    decode = sorted((w for w in workers if w.role != WorkerRole.PREFILL), key=behind)
    prefill = sorted((w for w in workers if w.role == WorkerRole.PREFILL), key=behind)
    count = max(1, -(-len(decode) // size))
    if prefill and len(prefill) < count:
        count = len(prefill)
        chunks = [decode[i * len(decode) // count:(i + 1) * len(decode) // count] for i in range(count)]
    else:
        chunks = [decode[i * size:(i + 1) * size] for i in range(count)]
    return [prefill[i * len(prefill) // count:(i + 1) * len(prefill) // count] + chunks[i] for i in range(count)]


def merged(reports: list[PublishReport], figure: str) -> dict:
    """One per-worker figure of the reports of a rolling publish's waves, together."""
    return {worker_id: value for report in reports for worker_id, value in getattr(report, figure).items()}


class Fence:
    def __init__(self, roster: Roster, pause_mode: PauseMode, probe_tolerance: float,
                 publish: PublishKind = "fenced", wave_size: int = 1) -> None:
        self.roster = roster
        self.pause_mode = pause_mode
        self.probe_tolerance = probe_tolerance
        self.publish_kind = publish
        self.wave_size = wave_size
        self._publishing = asyncio.Lock()  # one publish at a time; a rolling one until it has returned
        self._rest: asyncio.Task | None = None  # the waves a rolling publish runs after it returned
        self._superseded = False  # a newer publish waits: `_rest` stops after its wave under way
        self._closed = False  # the fleet closes: no wave starts any more
        self._unreported: list[WaveReport] = []  # waves ended since the last publish returned
        self.lock = asyncio.Lock()  # held by publish and by refits (a discovery round's included)
        self.source: WeightSource | None = None
        # Workers sent weights before any version was the fleet's: they hold the launch's no more.
        self._sent_before_promote: set[str] = set()
        # Each worker's refits (a publish's or a discovery round's), in order, as the versions they
        # installed: a request's tokens can only be of its worker's version at dispatch or of a
        # refit after it (`versions_since`), never of a version only other workers were given.
        self._installs: dict[str, list[int]] = {}
        # (worker id, refit) -> the verdict of that refit's agreement probe (its version is the
        # refit's in `_installs`): None, it agreed; else why not. Pending from the worker's resume until it is
        # scored; a failed one is kept, since a request held across that refit may still come
        # back from it (even after a later refit at the same version agreed).
        self._verdicts: dict[tuple[str, int], asyncio.Future[str | None]] = {}

    @property
    def checksum(self) -> str | None:
        """fleetrl checksum of the weights of the fleet's version; None at the base model of
        workers the provider launched (they received none)."""
        return self.source.checksum if self.source else None

    # -- publish ---------------------------------------------------------------------------

    async def publish(self, version: int, transport: WeightTransport, named_tensors: NamedTensors,
                      probe: AgreementProbe | None, keep: bool, everywhere: bool = False) -> PublishReport:
        """Fence every worker that is not dead (chosen under the lock, which discovery rounds
        hold too) at `version`: at once (see `_publish_to`), or in waves (`_publish_rolling`)."""
        started = time.monotonic()  # the report's seconds include the wait for the lock
        if self.publish_kind == "rolling":
            return await self._publish_rolling(version, transport, named_tensors, probe, keep,
                                               everywhere or not keep, started)
        async with self.lock:
            live = [w for w in self.roster.workers.values() if w.state != WorkerState.DEAD]
            return await self._publish_to(live, version, transport, named_tensors, probe, keep, started)

    async def _publish_rolling(self, version: int, transport: WeightTransport, named_tensors: NamedTensors,
                               probe: AgreementProbe | None, keep: bool, everywhere: bool,
                               started: float) -> PublishReport:
        """Fence the live workers in waves (see the module's docstring); return once a canary
        wave agreed (every wave where `everywhere`), the rest going on in `_rest`. PublishError
        if no wave completed anywhere."""
        async with self._publishing:
            await self.stop_waves(supersede=True)
            async with self.lock:
                live = [w for w in self.roster.workers.values() if w.state != WorkerState.DEAD]
            planned = plan_waves(live, self.wave_size)
            reports: list[PublishReport] = []
            number = 0
            while planned and self.roster.version < version:  # the canary: until a worker agrees
                self._refuse_when_closed(version)
                number += 1
                reports.append(await self._wave(Wave(number, True, planned.pop(0)), version, transport,
                                                named_tensors, probe, keep, started))
            if self.roster.version < version:
                raise PublishError(f"publish v{version} completed on no worker: {describe(merged(reports, 'failed'))}")
            planned += await self._missed_by_the_plan(planned, version)
            rest = [Wave(number + i, False, wave) for i, wave in enumerate(planned, 1)]
            self._refuse_when_closed(version)
            if everywhere:
                for wave in rest:
                    self._refuse_when_closed(version)
                    reports.append(await self._wave(wave, version, transport, named_tensors, probe, keep, started))
            elif rest:
                self._rest = asyncio.create_task(self._later_waves(rest, version, transport, named_tensors,
                                                                   probe, keep, started))
            waves, self._unreported = self._unreported, []
            return PublishReport(
                version=version, seconds=time.monotonic() - started,
                checksum=next(r.checksum for r in reports if r.ready),
                ready=[w for r in reports for w in r.ready], failed=merged(reports, "failed"),
                probe=merged(reports, "probe"), worker_seconds=merged(reports, "worker_seconds"),
                received_bytes=merged(reports, "received_bytes"), waves=waves)

    async def _missed_by_the_plan(self, planned: list[list[WorkerInfo]], version: int) -> list[list[WorkerInfo]]:
        """Waves for the live workers that serve an older version and that no wave still to run
        holds: those that joined, or were restarted (a canary's worker included), while the
        canary ran, whom a discovery round refitted to the version before (the fleet's until a
        canary agreed); without a wave they would serve it on. Stale ones are left to discovery,
        which refits them to `version` now."""
        waiting = {w.id for wave in planned for w in wave}
        async with self.lock:
            missed = [w for w in self.roster.workers.values() if w.id not in waiting and w.version != version
                      and w.state not in (WorkerState.DEAD, WorkerState.STALE)]
        if missed:
            self.roster.log(f"fleetrl: publish v{version}: {', '.join(w.id for w in missed)} joined or were "
                            f"refitted during the canary; waves of their own follow")
        return plan_waves(missed, self.wave_size)

    async def _later_waves(self, waves: list[Wave], version: int, transport: WeightTransport,
                           named_tensors: NamedTensors, probe: AgreementProbe | None, keep: bool,
                           started: float) -> None:
        """The waves of a rolling publish after it returned, one at a time, until a newer
        publish supersedes them. A failure is the wave's own (logged, its workers stale or dead),
        never the run's: the discovery loop or the next publish refits them."""
        for wave in waves:
            if self._superseded:
                self.roster.log(f"fleetrl: publish v{version}: waves {wave.number}.. superseded by a newer "
                                f"version; their workers take it directly")
                return
            try:
                await self._wave(wave, version, transport, named_tensors, probe, keep, started)
            except Exception as e:  # not PublishError, which `_wave` reports: a bug, or the fleet closing
                self.roster.log(f"fleetrl: publish v{version} wave {wave.number} failed: {e}")
                return

    def _refuse_when_closed(self, version: int) -> None:
        """A publish under way when the fleet closed starts no wave after it: none would outlive
        the run's close."""
        if self._closed:
            raise PublishError(f"publish v{version}: the fleet closed during it")

    async def close(self) -> None:
        """Start no wave from now on, and end those running in the background at once."""
        self._closed = True
        await self.stop_waves(supersede=False)

    async def stop_waves(self, supersede: bool) -> None:
        """End the waves a rolling publish runs in the background: after the wave under way
        (`supersede`: a newer publish takes over), or at once (the fleet closes)."""
        task, self._rest = self._rest, None
        if task is None:
            return
        self._superseded = True
        if not supersede:
            task.cancel()
        try:
            await asyncio.gather(task, return_exceptions=True)
        finally:
            self._superseded = False

    async def _wave(self, wave: Wave, version: int, transport: WeightTransport, named_tensors: NamedTensors,
                    probe: AgreementProbe | None, keep: bool, started: float) -> PublishReport:
        """Fence one wave's workers that still live (the lock held for it alone), then once more
        those of them that failed and are stale, not dead: a canary is refitted until it agrees,
        a worker that fails twice stays stale. Its report, `ready` empty where none came through."""
        began, began_wall = time.monotonic(), time.time()
        targets, fenced = wave.workers, []  # fenced: those alive when the wave began
        checksum, ready, failed = "", [], {}
        probed: dict[str, float] = {}
        worker_seconds: dict[str, float] = {}
        received: dict[str, int] = {}
        for attempt in range(2):
            async with self.lock:
                targets = [w for w in targets if w.state != WorkerState.DEAD]
                if not targets:
                    break
                if attempt == 0:
                    fenced = [w.id for w in targets]
                try:
                    report = await self._publish_to(targets, version, transport, named_tensors, probe, keep,
                                                    started, wave)
                except PublishError as e:
                    failed.update({w.id: w.error or str(e) for w in targets})
                else:
                    checksum = report.checksum
                    ready += report.ready
                    failed.update(report.failed)
                    probed.update(report.probe)
                    worker_seconds.update(report.worker_seconds)
                    received.update(report.received_bytes)
            targets = [w for w in targets if w.id in failed and w.id not in ready and w.state == WorkerState.STALE]
            if attempt == 0 and targets:
                self.roster.log(f"fleetrl: publish v{version} wave {wave.number}: refitting "
                                f"{', '.join(w.id for w in targets)} once more")
        failed = {k: v for k, v in failed.items() if k not in ready}
        done = WaveReport(version=version, wave=wave.number, canary=wave.canary, workers=fenced,
                          ready=ready, failed=failed, started=began_wall, seconds=time.monotonic() - began)
        self._unreported.append(done)
        self.roster.log(f"fleetrl: publish v{version} wave {wave.number}{' (canary)' if wave.canary else ''}: "
                        f"{', '.join(ready) or 'no worker'} at v{version} in {done.seconds:.1f} s"
                        + (f"; failed: {describe(failed)}" if failed else ""))
        return PublishReport(version=version, seconds=time.monotonic() - started, checksum=checksum, ready=ready,
                             failed=failed, worker_seconds=worker_seconds, probe=probed, received_bytes=received)

    async def _publish_to(self, targets: list[WorkerInfo], version: int, transport: WeightTransport,
                          named_tensors: NamedTensors, probe: AgreementProbe | None, keep: bool,
                          started: float, wave: Wave | None = None) -> PublishReport:
        """Fence `targets` (the lock held): pause -> transfer -> verify version + checksum ->
        resume -> each scores the agreement probe (when given) before it takes traffic. Once one
        is verified, `version` is the fleet's and the weights are its `source`.

        `keep`: `named_tensors` stays valid after the publish, and refits workers that join or
        go stale before the next one; False where it is valid only during this call (a stream
        gathered from a CUDA trainer's shards).

        Workers that fail are excluded (dead or stale, with the reason in the report) and the
        others complete the publish; if none completes, PublishError and nothing resumes. `wave`:
        the wave of a rolling publish `targets` are, named in its fence events."""
        roster = self.roster
        failed: dict[str, str] = {}
        done_s: dict[str, float] = {}  # worker id -> when, from the fence's start, it was verified (and probed)
        received: dict[str, int] = {}

        async def checked(worker: WorkerInfo, check: Awaitable[None]) -> None:
            await check
            done_s[worker.id] = time.monotonic() - started

        async def verify(worker: WorkerInfo, checksum: str) -> None:
            received[worker.id] = await self._verify(worker, version, checksum)

        labels = {} if wave is None else {"wave": wave.number, "canary": wave.canary}
        roster.on_event(FenceEvent(phase="start", version=version, **labels,
                                   **({} if wave is None else {"workers": [w.id for w in targets]})))
        resumed: list[WorkerInfo] = []
        agreed: set[str] = set()  # scored the probe within tolerance
        try:
            # One bounded health check first: a hung worker leaves the fence now, after one
            # timeout, instead of holding every step of the publish for its admin timeouts.
            targets = await roster.each(targets, roster.check_health, failed, WorkerState.DEAD)
            for worker in targets:
                roster.mark(worker, WorkerState.PAUSED)
            await roster.notify()
            admin = roster.provider.admin
            paused = await roster.each(targets, lambda w: admin(w).pause(self.pause_mode), failed, WorkerState.DEAD)
            for worker in paused:
                roster.mark(worker, WorkerState.UPDATING)
            if self.source is None:
                self._sent_before_promote.update(w.id for w in paused)
            checksum, updated = await self._transfer(paused, transport, named_tensors, version, failed)
            verified = await roster.each(updated, lambda w: checked(w, verify(w, checksum)), failed,
                                         WorkerState.STALE)
            if not verified:
                raise PublishError(f"publish v{version} completed on no worker: {describe(failed)}")
            source = WeightSource(transport, named_tensors if keep else None, checksum, probe, version)
            if wave is None:
                # From here on only workers verified at `version` take traffic: stale ones stay
                # paused, and a refit gives them these weights.
                self._promote(source)
            self._installing(verified, version, probe is not None)
            resumed = await roster.each(verified, roster.resume, failed, WorkerState.DEAD)
            deltas: dict[str, float] = {}
            if probe is not None:  # still UPDATING here: a worker that disagrees never takes a new request
                # Through a prefill worker of this fence, or one that already serves `version` (a
                # wave whose own prefill worker died, or which has none).
                prefills = [w for w in resumed if w.role == WorkerRole.PREFILL] or [
                    w for w in roster.workers.values()
                    if w.role == WorkerRole.PREFILL and w.state == WorkerState.READY and w.version == version]
                agree = await roster.each(
                    resumed, lambda w: checked(w, self._agrees(w, version, probe, prefills, deltas)), failed,
                    WorkerState.STALE)
                resumed = [w for w in resumed if w in agree]
                agreed = {w.id for w in resumed}
            if wave is not None and any(w.role != WorkerRole.PREFILL for w in resumed):
                # A wave's version goes no further, not even to a discovery round's refits between
                # its tries, until one of its workers agreed (a prefill worker scores no probe).
                self._promote(source)
            for worker in resumed:
                worker.version = version
                roster.mark(worker, WorkerState.READY)
        finally:
            self._settle_verdicts(version, agreed, failed)
            roster.on_event(FenceEvent(phase="end", version=version, ready=sorted(w.id for w in resumed), **labels))
        await roster.notify()
        if failed:
            roster.log(f"fleetrl: publish v{version} excluded {describe(failed)}")
        return PublishReport(version=version, seconds=time.monotonic() - started, checksum=checksum,
                             ready=[w.id for w in resumed], failed=failed, probe=deltas,
                             worker_seconds={w.id: done_s[w.id] for w in resumed},
                             received_bytes={w.id: received[w.id] for w in resumed})

    def _promote(self, source: WeightSource) -> None:
        """`source`'s version is the fleet's, and what a refit sends."""
        self.roster.version, self.source = source.version, source

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
                raise PublishError(f"publish v{version}: no live worker to publish to: {describe(failed)}")
            try:
                checksum = await transport.transfer([self.roster.provider.weight_sync(w) for w in workers],
                                                    named_tensors, version)
                return checksum, workers
            except Exception as e:
                culprits = [] if retried else await self._transfer_culprits(workers, e)
                if culprits:
                    retried = True
                    for worker in culprits:
                        failed[worker.id] = f"transfer of v{version} failed: {e}"
                        self.roster.mark(worker, WorkerState.DEAD, failed[worker.id])
                    workers = [w for w in workers if w not in culprits]
                    continue
                for worker in workers:
                    failed[worker.id] = f"transfer of v{version} failed: {e}"
                    self.roster.mark(worker, WorkerState.STALE, failed[worker.id])
                raise PublishError(f"publish v{version} failed: {describe(failed)}") from e

    async def _transfer_culprits(self, workers: list[WorkerInfo], error: Exception) -> list[WorkerInfo]:
        health = await asyncio.gather(*(self.roster.healthy(w) for w in workers))
        dead = [w for w, ok in zip(workers, health) if not ok]
        named = [w for w in workers if w.id == getattr(error, "worker_id", None)]
        return dead or named

    async def wait_for_version(self, version: int) -> None:
        """Return once the fleet serves `version` or newer (admission control waits here)."""
        async with self.roster.changed:
            await self.roster.changed.wait_for(lambda: self.roster.version >= version)

    # -- refit -----------------------------------------------------------------------------

    async def refit(self, worker: WorkerInfo) -> None:
        """Give one worker the fleet's current version before it takes any request (the lock
        held: a discovery round's)."""
        roster, version = self.roster, self.roster.version
        admin = roster.provider.admin(worker)
        # Seen for the first time, or after this run's claim on it may have lapsed (another run may
        # have refitted it meanwhile): what it holds is checked, and it is sent only what it lacks.
        first_sight = worker.state == WorkerState.JOINING or worker.id in roster.lapsed
        if not first_sight and self.source is not None and self.source.named_tensors is None:
            # Nothing to send it: stale (out of routing) until the next publish includes it.
            roster.mark(worker, WorkerState.STALE, f"refit to v{version} waits for the next publish: "
                                                   f"{UNKEPT_WEIGHTS}")
            return
        roster.mark(worker, WorkerState.SYNCING)
        try:
            # A worker that cannot say what its ranks hold (Dynamo's own worker started as plain
            # `python -m dynamo.vllm`) could never be verified: it is refused here, at every round,
            # before it is paused or sent anything, rather than after a refit it then fails.
            await admin.weight_state()
            await admin.pause(self.pause_mode)
            if self.source is None:
                # The fleet's version is that of the model folder the provider's workers loaded at
                # launch (`Lifecycle.start`'s launched_version): nothing was published since, so it
                # must hold them still, no rank having received anything. A canary sent the first
                # version (its probe failed, or its transfer broke off half-way) waits for a publish.
                if worker.id in self._sent_before_promote:
                    raise FleetrlError("it was sent weights of a version no canary agreed on; it waits for the "
                                       "next publish")
                await admin.verify_weights(None)
                await admin.set_version(version)
                reported = await admin.version()
                if reported != version:
                    raise FleetrlError(f"reports version {reported} after being set to v{version}")
            elif first_sight and (why := await self._unlike(worker, version, self.source.checksum)) is None:
                pass  # it holds them already (an attached worker at the base, say); the probe still decides
            elif self.source.named_tensors is None:
                raise FleetrlError(f"it {why}; it waits for the next publish: {UNKEPT_WEIGHTS}")
            else:
                sync = roster.provider.weight_sync(worker)
                if first_sight:
                    roster.log(f"fleetrl: worker {worker.id} {why}: refitting it with the weights of v{version}")
                    # A coordinator that died mid-publish (a run killed, then run again on the same
                    # attached workers) may have left an update open: the worker would refuse a new one.
                    await sync.abandon(version)
                checksum = await self.source.transport.transfer([sync], self.source.named_tensors, version)
                await self._verify(worker, version, checksum)
            probe = self.source.probe if self.source is not None else None
            self._installing([worker], version, probe is not None)
            await roster.resume(worker)
            if probe is not None:
                # Through a prefill worker at its own version: mid-rolling-publish, some hold an older one.
                prefills = [p for p in roster.ready_prefill_workers() if p.version == version]
                if roster.ready_prefill_workers() and not prefills and worker.role != WorkerRole.PREFILL:
                    raise FleetrlError(f"no ready prefill worker at v{version} to score the agreement probe through")
                await self._agrees(worker, version, probe, prefills)
        except Exception as e:
            self._settle_verdicts(version, set(), {worker.id: str(e)})
            roster.mark(worker, WorkerState.STALE, f"refit to v{version} failed: {e}")
            return
        self._settle_verdicts(version, {worker.id}, {})
        worker.version = version
        roster.mark(worker, WorkerState.READY)
        roster.log(f"fleetrl: worker {worker.id} ready at v{version}")

    async def _unlike(self, worker: WorkerInfo, version: int, checksum: str) -> str | None:
        """How the weights the worker reports differ from `version`'s; None if they do not. A
        worker seen for the first time is only sent what it lacks."""
        admin = self.roster.provider.admin(worker)
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
        admin = self.roster.provider.admin(worker)
        reported = await admin.version()
        if reported != version:
            raise FleetrlError(f"reports version {reported}, expected v{version}")
        return max((rank.received_bytes or 0 for rank in await admin.verify_weights(checksum)), default=0)

    # -- verdicts --------------------------------------------------------------------------

    def _installing(self, workers: list[WorkerInfo], version: int, probed: bool) -> None:
        """Before `workers` resume at `version`, a refit each: with a probe, their tokens at it are
        trusted only once they have agreed (`check_probed`)."""
        loop = asyncio.get_running_loop()
        for worker in workers:
            installs = self._installs.setdefault(worker.id, [])
            installs.append(version)
            if probed:
                self._verdicts[(worker.id, len(installs))] = loop.create_future()

    def _settle_verdicts(self, version: int, agreed: set[str], failed: dict[str, str]) -> None:
        """Every verdict pending at `version`: agreed, or failed (why; a worker that never got as
        far as its probe fails too). Agreed ones are dropped: no token of theirs waits on them."""
        for key, verdict in list(self._verdicts.items()):
            worker_id, refit = key
            if self._installs[worker_id][refit - 1] != version or verdict.done():
                continue
            if worker_id in agreed:
                verdict.set_result(None)
                del self._verdicts[key]
            else:
                verdict.set_result(failed.get(worker_id, "its publish failed before its probe"))

    def refits_of(self, workers: list[WorkerInfo]) -> dict[str, int]:
        """How many refits each of `workers` has had: taken at a request's dispatch."""
        return {w.id: len(self._installs.get(w.id, ())) for w in workers}

    def versions_since(self, worker: WorkerInfo, refits: int) -> list[int]:
        """The versions that the worker's refits after its first `refits` installed."""
        return self._installs.get(worker.id, [])[refits:]

    async def check_probed(self, serving: list[WorkerInfo], response: GenerateResponse,
                           dispatched: dict[str, int]) -> None:
        """Tokens produced at a version whose agreement probe their worker (or its prefill
        worker) then failed were not made by the trainer's weights: the response is flagged,
        never trained. Only the refits after its dispatch (`dispatched`: `refits_of` then) can
        have made its tokens: a worker dispatched to had agreed, and a failed refit is no
        concern of a request sent after a later one agreed. One that comes back while the probe
        is scored waits for its verdict: in keep mode a request held across a publish runs on
        as soon as its worker resumes."""
        versions = {span.version for span in response.spans}
        since = {w.id: self.versions_since(w, dispatched[w.id]) for w in serving}  # as it returned
        for worker in serving:
            for refit, version in enumerate(since[worker.id], start=dispatched[worker.id] + 1):
                verdict = self._verdicts.get((worker.id, refit))
                if verdict is None or version not in versions:
                    continue  # agreed (dropped), or it installed a version none of these tokens is of
                why = await asyncio.shield(verdict)
                if why is not None and response.version_error is None:
                    response.version_error = (f"worker {worker.id} failed the agreement probe at v{version} ({why}): "
                                              f"its tokens at v{version} are not trained")

    async def _agrees(self, worker: WorkerInfo, version: int, probe: AgreementProbe, prefills: list[WorkerInfo],
                      deltas: dict[str, float] | None = None) -> None:
        """The worker, just given `version`, scores the probe; more than `probe_tolerance` from
        the trainer's logprobs raises. Prefill workers only prefill (their scoring is a decode
        worker's): they are held to the checksum alone, and score through one of them where the
        fleet has some. The `probe` failpoint makes every score at its version fail."""
        if worker.role == WorkerRole.PREFILL:
            return
        served = await self.roster.provider.prompt_logprobs(worker, probe.token_ids,
                                                            prefills[0] if prefills else None)
        delta = max(abs(a - b) for a, b in zip(served, probe.logprobs, strict=True))
        if failpoints.tripped("probe", version):
            delta = math.inf
        if deltas is not None:
            deltas[worker.id] = delta
        if not delta <= self.probe_tolerance:  # a NaN disagrees too
            raise FleetrlError(f"agreement probe: logprobs differ from the trainer's by up to {delta:.3g} "
                               f"> inference.probe_tolerance = {self.probe_tolerance:g} (weights received but "
                               f"not installed as sent, or a tolerance below the engine's own noise)")
