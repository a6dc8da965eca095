"""The fleet's lifecycle: start, discovery rounds, claim renewals, restarts, close.

The provider lists the workers; each discovery round (every `discovery_interval_s`) marks the
ones it misses dead, and brings new, stale and returning ones to the fleet's version through the
fence's refit, under the fence's lock, so none serves before it holds that version. A dead
launched worker is started again while the run's restart budget (`inference.max_restarts`)
lasts; until its replacement is found alive, a fleet with no live worker waits for it, at most
`no_worker_timeout_s`, instead of failing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet.fence import Fence, WeightSource
from fleetrl.inference.fleet.roster import Roster
from fleetrl.inference.http import SINGLE_TRY
from fleetrl.inference.provider import ImpostorWorker, SameServerAs, WorkerHeldByAnotherRun
from fleetrl.inference.types import WorkerInfo, WorkerState
from fleetrl.processes import stopping


class Lifecycle:
    def __init__(self, roster: Roster, fence: Fence, discovery_interval_s: float, no_worker_timeout_s: float,
                 max_restarts: int) -> None:
        self.roster = roster
        self.fence = fence
        self.discovery_interval_s = discovery_interval_s
        self.no_worker_timeout_s = no_worker_timeout_s
        self.restarts_left = max_restarts  # over the whole run, all workers together
        self._restarts: set[asyncio.Task] = set()
        # The ids replacements of dead workers came up under (a Dynamo replacement is a new
        # instance), until the fleet finds them alive: a fleet with no live worker waits for them.
        self._replacements: set[str] = set()
        # Workers dead since a listing missed them while they answered their health check: the
        # next round finds them listed again (and refits them) or replaces them.
        self._unlisted: set[str] = set()
        self._discovery: asyncio.Task | None = None
        self._renewals: asyncio.Task | None = None

    async def start(self, weights: Callable[[], Awaitable[WeightSource]] | None, launched_version: int) -> None:
        """See `Fleet.start`."""
        roster = self.roster
        if weights is None and not roster.provider.launches_workers:
            raise FleetrlError(f"the {roster.provider.name} fleet attaches to workers fleetrl did not launch: "
                               "it needs the run's base weights to check them against before labelling them v0")
        await roster.provider.start()
        if weights is not None:
            self.fence.source = await weights()
            roster.version = self.fence.source.version
        else:
            roster.version = launched_version
        if roster.claim_trusted_s is not None:  # from the first claim on: refits one by one may take long
            self._renewals = asyncio.create_task(self._renewal_loop())
        await self.refresh()
        if not roster.routable_workers():
            raise FleetrlError("no inference worker became ready: " + roster.describe_failures())
        self._discovery = asyncio.create_task(self._discovery_loop())

    async def close(self) -> None:
        self.restarts_left = 0  # a worker that dies as the fleet stops is not started again
        for task in [self._discovery, self._renewals, *self._restarts]:
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.roster.provider.close()

    # -- discovery -------------------------------------------------------------------------

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
                self.roster.log(f"fleetrl: discovery failed: {e}")

    async def _renewal_loop(self) -> None:
        """Renew the run's claim on every worker it holds (a health check, which claims it) every
        discovery_interval_s, apart from the discovery rounds: a listing that fails or is slow, or
        a refit holding the fence, stops those, and a claim that lapsed meanwhile lets another run
        take a worker this run still routes to. A worker whose check fails is left to discovery;
        here it only goes unrenewed (`Roster.check_claims` then takes it out)."""
        while True:
            await asyncio.sleep(self.discovery_interval_s)
            await asyncio.gather(*(self.roster.health(w) for w in self.roster.held()), return_exceptions=True)
            self.roster.check_claims()

    async def refresh(self) -> None:
        """Mark vanished workers dead; bring new, stale or returning ones to the fleet's version.

        The publish fence is taken only after the provider's discovery (an etcd read, say, with
        its own retries) has answered, and every check under it is bounded by health_timeout_s:
        a slow discovery round never holds a publish back."""
        roster = self.roster
        discovered = {w.id: w for w in await roster.provider.discover()}
        async with self.fence.lock:
            await self._mark_unlisted(discovered)
            for worker_id, found in discovered.items():
                self._unlisted.discard(worker_id)
                known = roster.workers.get(worker_id)
                if known is None or (known.state == WorkerState.DEAD and known.admin_url != found.admin_url):
                    roster.workers[worker_id] = known = found  # new, or restarted elsewhere
                    self._replacements.discard(worker_id)  # found: it no longer holds a dead fleet's wait
                # A worker that does not answer (hung, or still starting) is not refitted now:
                # its admin calls would hold the fence for their whole timeouts.
                if known.state in (WorkerState.JOINING, WorkerState.STALE, WorkerState.DEAD) \
                        and await roster.healthy(known):
                    await self.fence.refit(known)
            await roster.each(roster.ready_workers(), roster.check_health, {}, WorkerState.DEAD)
            await roster.each(roster.ready_workers(), self._check_version, {}, WorkerState.STALE)
        await roster.notify()

    async def _mark_unlisted(self, listed: dict[str, WorkerInfo]) -> None:
        """Mark the workers this listing misses dead. One that still answers its health check is
        not replaced yet: a listing can miss a live worker for a moment (a Dynamo discovery entry
        refreshed late), and a replacement kills it. It is replaced if the next listing misses
        it too; if that one lists it, it is refitted like any returning worker."""
        workers = self.roster.workers.values()
        for worker in [w for w in workers if w.id in self._unlisted and w.id not in listed]:
            self._unlisted.discard(worker.id)
            worker.error = "gone from two discovery rounds in a row"
            self.roster.log(f"fleetrl: worker {worker.id} is {worker.error}")
            self._restart_soon(worker)
        missing = [w for w in workers if w.id not in listed and w.state != WorkerState.DEAD]
        await asyncio.gather(*(self._listing_missed(w) for w in missing))

    async def _listing_missed(self, worker: WorkerInfo) -> None:
        """A live worker this listing misses: dead, and restarted unless it answers its health
        check (`_mark_unlisted`); one another run holds now is stale, as in `Roster.healthy`, and
        never restarted: killing it would take a worker from the run that holds it."""
        try:
            answers = await self.roster.health(worker)
        except WorkerHeldByAnotherRun as e:
            self.roster.mark(worker, WorkerState.STALE, str(e))
            return
        except (ImpostorWorker, SameServerAs):
            answers = False
        if answers:
            self._unlisted.add(worker.id)
            self.roster.mark(worker, WorkerState.DEAD, "gone from discovery, though it answers its health check: "
                                                       "replaced if the next round does not list it either",
                             restart=False)
        else:
            self.roster.mark(worker, WorkerState.DEAD, "gone from discovery")

    async def _check_version(self, worker: WorkerInfo) -> None:
        """A worker restarted at the same address comes back with the base weights: it no
        longer reports the version it was verified at, so it is stale until refitted. Only an
        answer counts: a busy worker that is slow to answer passed its health check."""
        try:
            async with asyncio.timeout(self.roster.health_timeout_s):  # not through the admin client's retries
                reported = await self.roster.provider.admin(worker).version()
        except ImpostorWorker:
            raise  # not an answer that is missing: an answer from something else
        except (FleetrlError, TimeoutError):
            return
        if reported != worker.version:
            raise FleetrlError(f"reports version {reported} but was verified at v{worker.version} "
                               f"(restarted?); refitting it")

    # -- restarts --------------------------------------------------------------------------

    def marked(self, worker: WorkerInfo, state: WorkerState, restart: bool) -> None:
        """`Roster.on_mark`: `worker` is about to be in `state`. One that dies is started again
        (unless `restart` is False); one that lives no longer holds a dead fleet's wait."""
        if state == WorkerState.DEAD and worker.state != state and restart:
            self._restart_soon(worker)
        if state != WorkerState.DEAD:
            self._replacements.discard(worker.id)

    def restart_pending(self) -> bool:
        """Whether a dead worker may soon serve again: one is being started again, a replacement
        that came up has not been found alive by discovery yet, or a worker a listing missed
        still answered (the next round lists it again or replaces it). While one may, a fleet
        with no live worker waits (bounded by `no_worker_timeout_s`); once none may, it fails."""
        return bool(self._restarts or self._unlisted) or any(
            (w := self.roster.workers.get(worker_id)) is None or w.state == WorkerState.DEAD
            for worker_id in self._replacements)

    async def until_a_worker_lives(self) -> None:
        """With every worker dead and one being started again (one worker, say), a publish
        waits for it, at most `no_worker_timeout_s`: outside the fence, under which the
        discovery loop brings it back at the fleet's version first."""
        deadline = time.monotonic() + self.no_worker_timeout_s
        changed = self.roster.changed
        async with changed:
            while (self.restart_pending() and all(w.state == WorkerState.DEAD for w in self.roster.workers.values())
                   and time.monotonic() < deadline):
                try:
                    async with asyncio.timeout(self.discovery_interval_s):
                        await changed.wait()
                except TimeoutError:
                    pass

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
        log = self.roster.log
        if stopping():  # it died because fleetrl is stopping it (a SIGTERM, say)
            log(f"fleetrl: worker {worker.id} not restarted: fleetrl is stopping")
            return
        self.restarts_left -= 1  # taken before the await: workers that die together cannot overspend it
        try:
            replacement = await self.roster.provider.restart(worker)
        except FleetrlError as e:  # its replacement exited or never came up
            log(f"fleetrl: worker {worker.id} not restarted: {'fleetrl is stopping' if stopping() else e}")
            replacement = None
        if replacement is None:
            self.restarts_left += 1
            return
        found = self.roster.workers.get(replacement)
        if found is None or found.state == WorkerState.DEAD:  # not refitted yet: awaited by a fleet with none alive
            self._replacements.add(replacement)
        serves = "it serves again" if replacement == worker.id else f"its replacement, {replacement}, serves"
        log(f"fleetrl: worker {worker.id} restarted ({self.restarts_left} restart(s) left, "
            f"inference.max_restarts); {serves} once refitted")
