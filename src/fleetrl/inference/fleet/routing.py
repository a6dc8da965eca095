"""Routing: which ready worker serves a request, and what happens when it fails.

Requests only go to READY workers, chosen here (least in-flight, or sticky per session), so a
worker that appears in discovery serves nothing before it holds the fleet's current version. In a
rolling publish ready workers hold different versions: a request goes only to one at most
`max_lag` versions behind the newest published, and its prompt only to a prefill worker at the
same version as it. A
request whose worker died is sent again elsewhere, as is one a healthy worker failed; one cut by
an abort-mode publish is continued. Every response is checked against what the fleet published
while it ran (its spans, its workers' probe verdicts and claims): one that fails is flagged, and
its tokens are never trained.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from dataclasses import replace

from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet.fence import Fence
from fleetrl.inference.fleet.lifecycle import Lifecycle
from fleetrl.inference.fleet.roster import Roster
from fleetrl.inference.types import (GenerateRequest, GenerateResponse, UnversionedTokens, WorkerInfo, WorkerRole,
                                     WorkerState)
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


class Routing:
    def __init__(self, roster: Roster, fence: Fence, lifecycle: Lifecycle, max_lag: int | None = None) -> None:
        self.roster = roster
        self.fence = fence
        self.lifecycle = lifecycle  # how long to wait for workers, and whether dead ones may return
        # A worker more versions than this behind the newest published takes no request (the
        # run's k, orchestrator.max_off_policy_steps); None: no bound (every ready worker of a
        # fenced publish holds the newest).
        self.max_lag = max_lag
        self.transient_errors = 0  # requests sent again after a healthy worker failed them
        # Worker id -> its samples that failed answers.py's checks (dropped by the orchestrator).
        self.bad_answers: Counter[str] = Counter()
        # Worker id -> its answers in a row with a bad sample, up to BAD_ANSWERS_BEFORE_STALE.
        self._bad_in_a_row: Counter[str] = Counter()
        self._inflight: dict[str, int] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # session id -> worker id
        self._unready_since: float | None = None  # since when requests wait with no worker ready

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
        roster = self.roster
        deaths_left, transient_left = 2, TRANSIENT_RETRIES
        failed_on: set[str] = set()
        while True:
            worker, prefill = await self._acquire(request.session_id, request.min_version, avoid=failed_on)
            serving = [w for w in (worker, prefill) if w is not None]
            held = worker.version  # its tokens are of this version or newer
            refits = self.fence.refits_of(serving)  # those after this dispatch may have made its tokens
            lapses = {w.id: roster.lapses[w.id] for w in serving}
            try:
                responses = await roster.provider.generate(worker, request, suffix, prefill)
                break
            except UnversionedTokens as e:
                # Restarted behind the fleet's back (its address, its base weights): stale until
                # the discovery loop refits it; the request waits for a ready worker meanwhile.
                bad = roster.workers.get(e.worker_id, worker)
                roster.mark(bad, WorkerState.STALE, str(e))
                await roster.notify()
            except Exception as e:  # a malformed answer surfaces as KeyError, ValueError, ...
                dead = [w for w in serving if not await roster.healthy(w)]
                if dead and deaths_left:
                    deaths_left -= 1
                    for w in dead:
                        roster.mark(w, WorkerState.DEAD, f"died serving {request.request_id}: {e}")
                    await roster.notify()
                elif not dead and transient_left:
                    transient_left -= 1
                    self.transient_errors += 1
                    failed_on.add(worker.id)
                    roster.log(f"fleetrl: request {request.request_id} failed on healthy worker {worker.id} "
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
            self._check_versions(worker, response, held, refits[worker.id])
            await self.fence.check_probed(serving, response, refits)
            roster.check_claimed(serving, response, lapses)
        return responses

    async def _answered_badly(self, worker: WorkerInfo, bad: list[GenerateResponse]) -> None:
        """Samples of the worker's answer failed their checks (inference/answers.py): they carry
        no tokens and the orchestrator drops them (`bad_answer`); the request is not sent again
        and the run goes on. They count against the worker like a failed request: counted and
        logged, and a worker that then fails its health check is dead; one that answered badly
        BAD_ANSWERS_BEFORE_STALE times in a row is stale until the discovery loop refits it."""
        roster = self.roster
        self.bad_answers[worker.id] += len(bad)
        self._bad_in_a_row[worker.id] += 1
        roster.log(f"fleetrl: {bad[0].answer_error}; {len(bad)} sample(s) dropped (bad_answer)")
        if worker.state != WorkerState.DEAD and not await roster.healthy(worker):
            self._bad_in_a_row.pop(worker.id)
            roster.mark(worker, WorkerState.DEAD, f"failed its health check after a bad answer: {bad[0].answer_error}")
            await roster.notify()
        elif worker.state == WorkerState.READY and self._bad_in_a_row[worker.id] >= BAD_ANSWERS_BEFORE_STALE:
            self._bad_in_a_row.pop(worker.id)
            roster.mark(worker, WorkerState.STALE, f"answered badly {BAD_ANSWERS_BEFORE_STALE} times in a row "
                                                   f"(the last: {bad[0].answer_error})")
            await roster.notify()

    def _check_versions(self, worker: WorkerInfo, response: GenerateResponse, held: int, refits: int) -> None:
        """Second line of defence: the engine's spans must be of versions its worker was given:
        the one it held at dispatch (`held`), or one a refit of it installed since (`refits`: its
        count then). A rolling wave serves its version from its resume on, before its probe has
        made it the fleet's: those tokens wait for the probe's verdict (check_probed); a version
        that only other workers were given is no worker's to claim. A response outside is
        flagged (its sample must not be trained on) and the worker goes stale until the next
        discovery round refits it."""
        versions = {span.version for span in response.spans}
        given = [held, *self.fence.versions_since(worker, refits)]
        if not versions <= set(given):
            response.version_error = (f"worker {worker.id} produced tokens at versions {sorted(versions)}, "
                                      f"not those it was given while the request ran ("
                                      + ", ".join(f"v{v}" for v in given) + ")")
            if worker.state == WorkerState.READY:
                self.roster.mark(worker, WorkerState.STALE, response.version_error)
                self.roster.log(f"fleetrl: request {response.request_id}: {response.version_error}; worker stale")

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
                # Never older than its head: in a rolling publish the fleet serves two versions.
                min_version=max((v for v in (request.min_version, *(s.version for s in response.spans))
                                 if v is not None), default=None),
            )
            (rest,) = await self._generate_once(continuation, response.token_ids)
            response = join_completions(response, rest)
        return response

    async def _acquire(self, session_id: str | None, min_version: int | None = None,
                       avoid: set[str] = frozenset()) -> tuple[WorkerInfo, WorkerInfo | None]:
        """An admitted worker (at `min_version` or newer, if given) to pin the request to (not
        one in `avoid` if another is admitted), and,
        when the fleet has prefill workers, a ready prefill worker for its prompt: both chosen
        here, so that neither can be a worker that has not been brought to the fleet's version."""
        roster = self.roster
        async with roster.changed:
            while not (ready := self._admitted(min_version)):
                self._check_some_worker_may_serve()
                try:
                    async with asyncio.timeout(self.lifecycle.discovery_interval_s):
                        await roster.changed.wait()
                except TimeoutError:
                    pass  # look again: the run must not wait forever for workers that never return
            self._unready_since = None
            ready = [w for w in ready if w.id not in avoid] or ready
            worker = roster.workers.get(self._sticky.get(session_id, ""))
            if worker is None or worker.id not in {w.id for w in ready} or worker.id in avoid:
                worker = self._least_busy(ready)
            if session_id is not None:
                self._sticky[session_id] = worker.id
                self._sticky.move_to_end(session_id)
                if len(self._sticky) > STICKY_SESSIONS:
                    self._sticky.popitem(last=False)
            prefills = [p for p in roster.ready_prefill_workers() if p.version == worker.version]
            prefill = self._least_busy(prefills) if prefills else None
            for w in (worker, prefill):
                if w is not None:
                    self._inflight[w.id] = self._inflight.get(w.id, 0) + 1
            return worker, prefill

    def _check_some_worker_may_serve(self) -> None:
        """Raise when no worker can serve and none will soon: all are dead, or none has been
        ready, paused for a publish, or being refitted for `no_worker_timeout_s`."""
        workers, timeout_s = self.roster.workers.values(), self.lifecycle.no_worker_timeout_s
        decode = [w for w in workers if w.role != WorkerRole.PREFILL]
        if all(w.state == WorkerState.DEAD for w in decode) and not self.lifecycle.restart_pending():
            raise FleetrlError("no live inference worker: " + self.roster.describe_failures())
        in_transition = (WorkerState.PAUSED, WorkerState.UPDATING, WorkerState.SYNCING)
        if any(w.state in in_transition for w in workers):
            self._unready_since = None  # a publish or a refit is under way
            return
        now = time.monotonic()
        self._unready_since = self._unready_since or now
        if now - self._unready_since > timeout_s:
            raise FleetrlError(f"no inference worker has been ready for {timeout_s:g} s "
                               f"(inference.no_worker_timeout_s): {self.roster.describe_failures()}")

    def _admitted(self, min_version: int | None = None) -> list[WorkerInfo]:
        """The routable workers a request may go to now: at most `max_lag` versions behind the
        newest published and at `min_version` or newer (what the request's tokens must be of: in a
        rolling publish the newest can run ahead of the batch being sampled), and, where the fleet
        has prefill workers that live, with a ready one at the same version (if all are dead,
        decode workers serve alone): one request's prefill and decode never run at two versions."""
        newest = self.roster.version
        prefills = [w for w in self.roster.workers.values() if w.role == WorkerRole.PREFILL]
        alone = all(w.state == WorkerState.DEAD for w in prefills)
        prefilled_at = {w.version for w in self.roster.ready_prefill_workers()}
        return [w for w in self.roster.routable_workers()
                if (self.max_lag is None or newest - w.version <= self.max_lag)
                and (min_version is None or w.version >= min_version)
                and (alone or w.version in prefilled_at)]

    def in_flight(self, worker_id: str) -> int:
        """Requests this coordinator has sent the worker that have not come back yet."""
        return self._inflight.get(worker_id, 0)

    def _least_busy(self, workers: list[WorkerInfo]) -> WorkerInfo:
        return min(workers, key=lambda w: self.in_flight(w.id))


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
