"""Rolling publishes (inference.publish = "rolling") against the in-process fake provider:
workers at two versions at once, each token carrying its worker's; the off-policy bound at
every dispatch; the canary; a worker lost mid-wave; a worker that skips a version."""

import asyncio
from dataclasses import replace

import pytest

from fleetrl import failpoints
from fleetrl.inference.fleet import AgreementProbe, Fleet
from fleetrl.inference.fleet.fence import PublishError, plan_waves
from fleetrl.inference.types import GenerateRequest, GenerateResponse, SamplingParams, WorkerInfo, WorkerRole, WorkerState
from fleetrl.orchestrator.episodes import Episode, EpisodeLimits, turn_min_version
from fleetrl.records import FenceEvent, PublishReport
from fleetrl.versions import VersionSpan

from .fake_fleet import FakeProvider, FakeTransport

PROBE = AgreementProbe([1, 2], [-1.0])


def weights():
    return iter([("w", None)])


def request(max_tokens=20, **kw):
    return GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=max_tokens), **kw)


async def rolling(*ids, wave=1, max_lag=None, step_s=0.002, prefill=()):
    provider = FakeProvider(*ids, step_s=step_s)
    for worker_id in prefill:
        provider.add(worker_id, WorkerRole.PREFILL)
    provider.prompt_logprobs = lambda worker, token_ids, prefill=None: asyncio.sleep(0, [-1.0])
    events = []
    fleet = Fleet(provider, discovery_interval_s=3600, log=lambda *_: None, on_event=events.append,
                  publish="rolling", publish_wave=wave, max_lag=max_lag)
    await fleet.start()
    return fleet, provider, FakeTransport(provider), events


def hold_health(provider, fleet, worker_id) -> asyncio.Event:
    """Hold the health check that opens the worker's wave: it keeps serving (ready) meanwhile."""
    control = provider.admin(fleet.workers[worker_id])
    release, checked = asyncio.Event(), control.health

    async def held() -> bool:
        await release.wait()
        return await checked()

    control.health = held
    return release


def record_dispatches(provider, fleet) -> list[tuple[int, str, int, int | None]]:
    """(newest published version, worker, its version, its prefill worker's) at every dispatch."""
    seen, generate = [], provider.generate

    async def recorded(worker, request, prompt_suffix=(), prefill=None):
        seen.append((fleet.version, worker.id, worker.version, prefill.version if prefill else None))
        return await generate(worker, request, prompt_suffix, prefill)

    provider.generate = recorded
    return seen


async def waves_end(fleet) -> None:
    if fleet.fence._rest is not None:
        await asyncio.wait_for(asyncio.shield(fleet.fence._rest), 10)


async def test_two_workers_serve_two_versions_at_one_moment_with_exact_spans():
    fleet, provider, transport, events = await rolling("a", "b", max_lag=1, step_s=0.005)
    release = hold_health(provider, fleet, "b")
    report = await fleet.publish(1, transport, weights, PROBE)
    # The trainer has its publish back after the canary wave; b still serves v0.
    assert report.ready == ["a"] and fleet.version == 1
    assert [(w.wave, w.canary, w.workers, w.ready) for w in report.waves] == [(1, True, ["a"], ["a"])]
    assert {w.id: (w.state, w.version) for w in fleet.workers.values()} == {
        "a": (WorkerState.READY, 1), "b": (WorkerState.READY, 0)}
    tasks = [asyncio.create_task(fleet.generate(request(max_tokens=30))) for _ in range(2)]
    await asyncio.sleep(0.03)
    assert all(not t.done() for t in tasks) and {e.served for e in provider.engines.values()} == {1}
    outs = {out.worker_id: out for (out,) in await asyncio.gather(*tasks)}
    assert outs["a"].spans == [VersionSpan(1, 0)] and outs["b"].spans == [VersionSpan(0, 0)]
    assert all(t // 1000 == {"a": 1, "b": 0}[w] for w, out in outs.items() for t in out.token_ids)
    assert all(out.version_error is None for out in outs.values())
    release.set()
    await waves_end(fleet)
    assert all(w.state == WorkerState.READY and w.version == 1 for w in fleet.workers.values())
    fences = [(e.phase, e.wave, e.canary, e.workers, e.ready) for e in events if isinstance(e, FenceEvent)]
    assert fences == [("start", 1, True, ["a"], None), ("end", 1, True, None, ["a"]),
                      ("start", 2, False, ["b"], None), ("end", 2, False, None, ["b"])]
    # The next publish's report carries the waves that went on after the last one returned.
    report = await fleet.publish(2, transport, weights, PROBE, everywhere=True)
    assert [(w.version, w.wave, w.ready) for w in report.waves] == [(1, 2, ["b"]), (2, 1, ["a"]), (2, 2, ["b"])]
    assert sorted(report.ready) == ["a", "b"]
    await fleet.close()


async def test_no_request_goes_to_a_worker_more_than_k_versions_behind_and_a_late_worker_skips_a_version():
    """v2 supersedes v1's waves right after v1's canary: b, still at v0, is v2's canary; c, at
    v0 too, is two versions behind while v2's waves run and takes no request (k = 1) until it
    takes v2 directly, never v1. Requests run all along."""
    fleet, provider, transport, _ = await rolling("a", "b", "c", max_lag=1)
    seen = record_dispatches(provider, fleet)
    release = hold_health(provider, fleet, "c")  # v2's second wave waits, c two versions behind
    stop = asyncio.Event()

    async def sampling():
        while not stop.is_set():
            outs = await asyncio.gather(*(fleet.generate(request(max_tokens=5)) for _ in range(3)))
            assert all(out.version_error is None for (out,) in outs)

    load = asyncio.create_task(sampling())
    await asyncio.sleep(0.02)
    await fleet.publish(1, transport, weights, PROBE)
    assert {w.id: w.version for w in fleet.workers.values()} == {"a": 1, "b": 0, "c": 0}
    report = await fleet.publish(2, transport, weights, PROBE)  # before v1's next wave begins
    assert report.ready == ["b"]
    assert {w.id: w.version for w in fleet.workers.values()} == {"a": 1, "b": 2, "c": 0}
    await asyncio.sleep(0.05)
    assert {w.id: w.version for w in fleet.workers.values()} == {"a": 1, "b": 2, "c": 0}
    release.set()
    await waves_end(fleet)
    await asyncio.sleep(0.02)
    stop.set()
    await load
    assert all(newest - version <= 1 for newest, _, version, _ in seen)
    assert {(newest, version) for newest, _, version, _ in seen} >= {(2, 1), (2, 2)}  # two versions served at once
    assert [version for ids, version in transport.transfers if "c" in ids] == [2]
    assert all(w.version == 2 for w in fleet.workers.values())
    await fleet.close()


async def test_a_canary_that_fails_its_probe_holds_the_version_until_it_is_refitted_and_agrees():
    fleet, provider, transport, _ = await rolling("a", "b")
    scores = iter([[-3.0], [-1.0], [-1.0]])  # a's first install is wrong, its refit right

    async def score(worker, token_ids, prefill=None):
        return next(scores)

    provider.prompt_logprobs = score
    report = await fleet.publish(1, transport, weights, PROBE, everywhere=True)
    assert transport.transfers == [(["a"], 1), (["a"], 1), (["b"], 1)]  # b only once a agreed
    assert sorted(report.ready) == ["a", "b"] and not report.failed
    assert [(w.wave, w.canary, w.ready, w.failed) for w in report.waves] == [(1, True, ["a"], {}), (2, False, ["b"], {})]
    await fleet.close()


async def test_the_probe_failpoint_fails_every_score_at_its_version_while_it_is_set(monkeypatch):
    """What the real-process canary test (integration/test_providers.py) arms: each score at v1
    fails until the test unsets the variable, here at the canary's first failed fence."""
    fleet, provider, transport, _ = await rolling("a", "b")
    monkeypatch.setenv(failpoints.ENV, "probe:1")

    def disarm(event):
        if isinstance(event, FenceEvent) and event.phase == "end":
            monkeypatch.delenv(failpoints.ENV, raising=False)

    fleet.on_event = disarm
    report = await fleet.publish(1, transport, weights, PROBE, everywhere=True)
    assert transport.transfers == [(["a"], 1), (["a"], 1), (["b"], 1)]  # b only once a agreed
    assert sorted(report.ready) == ["a", "b"] and report.probe == {"a": 0.0, "b": 0.0}
    monkeypatch.setenv(failpoints.ENV, "probe:1")  # armed for another version: a no-op
    report = await fleet.publish(2, transport, weights, PROBE, everywhere=True)
    assert sorted(report.ready) == ["a", "b"] and not report.failed
    await fleet.close()


async def test_a_canary_that_fails_twice_is_quarantined_and_the_next_wave_is_the_canary():
    fleet, provider, transport, _ = await rolling("a", "b", "c")

    async def score(worker, token_ids, prefill=None):
        return [-3.0 if worker.id == "a" else -1.0]

    provider.prompt_logprobs = score
    release = hold_health(provider, fleet, "c")
    report = await fleet.publish(1, transport, weights, PROBE)
    assert transport.transfers == [(["a"], 1), (["a"], 1), (["b"], 1)]
    assert report.ready == ["b"] and "agreement probe" in report.failed["a"]
    assert [(w.wave, w.canary, w.ready, list(w.failed)) for w in report.waves] == [
        (1, True, [], ["a"]), (2, True, ["b"], [])]
    assert fleet.workers["a"].state == WorkerState.STALE  # out of routing, as a fenced publish leaves it
    release.set()
    await waves_end(fleet)
    assert (fleet.workers["c"].state, fleet.workers["c"].version) == (WorkerState.READY, 1)
    await fleet.close()


async def test_a_worker_lost_mid_wave_leaves_it_and_the_publish_reaches_the_others():
    fleet, provider, transport, _ = await rolling("a", "b", "c", "d", wave=2)
    transport.kill_worker = "d"  # dies in the transfer of the second wave, c, d
    report = await fleet.publish(1, transport, weights, everywhere=True)  # the run's last: every wave
    assert transport.transfers == [(["a", "b"], 1), (["c", "d"], 1), (["c"], 1)]
    assert sorted(report.ready) == ["a", "b", "c"] and "connection reset" in report.failed["d"]
    assert [(w.wave, w.workers, w.ready, list(w.failed)) for w in report.waves] == [
        (1, ["a", "b"], ["a", "b"], []), (2, ["c", "d"], ["c"], ["d"])]
    assert fleet.workers["d"].state == WorkerState.DEAD
    assert all(fleet.workers[w].version == 1 for w in "abc")
    await fleet.close()


async def test_a_prefill_worker_and_the_decode_workers_it_feeds_switch_in_one_wave():
    fleet, provider, transport, _ = await rolling("d1", "d2", prefill=("p1", "p2"))
    await fleet.refresh()
    seen = record_dispatches(provider, fleet)
    release = hold_health(provider, fleet, "d2")
    await fleet.publish(1, transport, weights)
    assert {w.id: w.version for w in fleet.workers.values()} == {"d1": 1, "d2": 0, "p1": 1, "p2": 0}
    outs = await asyncio.gather(*(fleet.generate(request(max_tokens=3)) for _ in range(6)))
    assert {o.worker_id for (o,) in outs} == {"d1", "d2"}
    assert seen and all(version == prefilled for _, _, version, prefilled in seen)
    release.set()
    await waves_end(fleet)
    assert all(w.version == 1 for w in fleet.workers.values())
    await fleet.close()


def test_waves_take_the_workers_furthest_behind_first_and_share_out_prefill_workers():
    def worker(worker_id, version, role=WorkerRole.AGGREGATED):
        return WorkerInfo(id=worker_id, data_url="", admin_url="", role=role, version=version)

    workers = [worker("a", 2), worker("b", 1), worker("c", None), worker("d", 2)]
    assert [[w.id for w in wave] for wave in plan_waves(workers, 1)] == [["c"], ["b"], ["a"], ["d"]]
    assert [[w.id for w in wave] for wave in plan_waves(workers, 3)] == [["c", "b", "a"], ["d"]]
    prefill = [worker("p", 0, WorkerRole.PREFILL), worker("q", 0, WorkerRole.PREFILL)]
    assert [[w.id for w in wave] for wave in plan_waves(workers + prefill, 1)] == [["p", "c", "b"], ["q", "a", "d"]]
    assert [[w.id for w in wave] for wave in plan_waves(prefill, 1)] == [["p", "q"]] and plan_waves([], 1) == []


async def test_a_fenced_publish_names_no_wave():
    provider = FakeProvider("a", "b")
    events = []
    fleet = Fleet(provider, discovery_interval_s=3600, log=lambda *_: None, on_event=events.append, max_lag=0)
    await fleet.start()
    report = await fleet.publish(1, FakeTransport(provider), weights)
    assert "waves" not in report.to_dict() and report.waves is None
    assert [set(e.to_dict()) for e in events if isinstance(e, FenceEvent)] == [{"phase", "version", "ready", "t"}] * 2
    assert PublishReport.read(report.to_dict(), "test") == report
    await fleet.close()


async def test_a_discovery_round_between_a_failed_canarys_tries_refits_a_joiner_to_the_version_before():
    """The canary a fails its probe at v1; a discovery round that runs between its two tries
    refits the worker that joined meanwhile to v0: v1 goes no further until a canary agreed."""
    fleet, provider, transport, _ = await rolling("a", "b")
    provider.add("c")

    async def score(worker, token_ids, prefill=None):
        return [-3.0 if worker.id == "a" else -1.0]

    provider.prompt_logprobs = score
    refitted, refit, rounds = [], fleet.fence.refit, []

    async def recorded(worker):
        await refit(worker)
        refitted.append((worker.id, worker.state, worker.version))

    def discovery_after_the_first_failed_fence(event):
        if isinstance(event, FenceEvent) and event.phase == "end" and not event.ready and not rounds:
            rounds.append(asyncio.get_running_loop().create_task(fleet.refresh()))  # it waits for the lock

    fleet.fence.refit = recorded
    fleet.on_event = discovery_after_the_first_failed_fence
    report = await fleet.publish(1, transport, weights, PROBE, everywhere=True)
    await asyncio.gather(*rounds)
    # a received v1's weights: it is not labelled v0 (nothing to send it before a canary agreed).
    assert ("c", WorkerState.READY, 0) in refitted and ("a", WorkerState.STALE, 0) in refitted
    assert report.ready and "a" in report.failed and fleet.workers["a"].state == WorkerState.STALE
    # The joiner was in no planned wave: a wave of its own brings it to v1 too, so that the last
    # publish of a run leaves no worker serving the version before (final.json, verify).
    assert {w.id: w.version for w in fleet.ready_workers()} == {"b": 1, "c": 1}
    assert [w.workers for w in report.waves][-1] == ["c"]
    await fleet.close()


async def test_a_joiner_refitted_while_the_publish_waited_for_the_lock_gets_a_wave():
    """No failure at all: a discovery round queued on the lock behind the publish's plan runs
    before the canary, and refits a worker that joined to v0; it is in no planned wave."""
    fleet, provider, transport, _ = await rolling("a", "b")
    provider.add("c")
    await fleet.fence.lock.acquire()  # a round's refits hold it
    publish = asyncio.create_task(fleet.publish(1, transport, weights, PROBE, everywhere=True))
    await asyncio.sleep(0)  # the publish queues first ...
    round_ = asyncio.create_task(fleet.refresh())  # ... then a discovery round
    await asyncio.sleep(0)
    fleet.fence.lock.release()
    await publish
    await round_
    assert {w.id: (w.state, w.version) for w in fleet.workers.values()} == {
        "a": (WorkerState.READY, 1), "b": (WorkerState.READY, 1), "c": (WorkerState.READY, 1)}
    await fleet.close()


async def test_a_refit_scores_the_probe_through_a_prefill_worker_at_its_own_version():
    fleet, provider, transport, _ = await rolling("d1", "d2", prefill=("pz", "pa"))
    await fleet.refresh()
    scored = []

    async def score(worker, token_ids, prefill=None):
        scored.append((worker.id, prefill.id, prefill.version))
        return [-1.0]

    provider.prompt_logprobs = score
    release = hold_health(provider, fleet, "d2")
    await fleet.publish(1, transport, weights, PROBE)  # pa and d1 at v1; pz and d2 still at v0
    provider.add("d3")
    await fleet.refresh()
    assert (fleet.workers["d3"].state, fleet.workers["d3"].version) == (WorkerState.READY, 1)
    assert [s for s in scored if s[0] == "d3"] == [("d3", "pa", 1)]
    release.set()
    await waves_end(fleet)
    await fleet.close()


async def test_a_later_turn_or_continuation_never_goes_to_a_worker_older_than_the_tokens_before_it():
    """k = 1, v1 on the canary a alone. An episode's first turn ran on a at v1; a is lost, and
    the next turn (or an abort-mode continuation) waits for a worker at v1 rather than going
    to b at v0: spans that went back in version would fail `fleetrl verify`."""
    fleet, provider, transport, _ = await rolling("a", "b", max_lag=1)
    release = hold_health(provider, fleet, "b")
    await fleet.publish(1, transport, weights, PROBE)
    limits = EpisodeLimits(max_turns=2, max_context=4096, max_off_policy_steps=1, partial_episodes=False,
                           user_code_timeout_s=1)
    episode = Episode(task=None, prompt_ids=[1, 2, 3], messages=[], state={})
    assert turn_min_version(episode, 2, limits) == 0  # (2 - 1) - k: the first turn may go to either
    assert turn_min_version(episode, 3, limits) == 1
    assert turn_min_version(episode, 3, replace(limits, partial_episodes=True)) is None
    (first,) = await fleet.generate(request(max_tokens=3, min_version=1, session_id="ep"))
    episode.add_model_turn(first)
    assert first.worker_id == "a" and turn_min_version(episode, 2, limits) == 1  # its turn before: v1
    provider.engines["a"].alive = False
    second = asyncio.create_task(fleet.generate(request(max_tokens=3, min_version=1, session_id="ep")))
    await asyncio.sleep(0.05)
    assert not second.done()  # b is at v0: the turn waits for b's wave
    release.set()
    ((out,),) = await asyncio.gather(second)
    assert out.worker_id == "b" and out.spans == [VersionSpan(1, 0)]
    # An abort-mode continuation is held to the version of the head it continues the same way.
    seen, generate = [], provider.generate

    async def cut_once(worker, req, suffix=(), prefill=None):
        seen.append(req.min_version)
        if len(seen) == 1:
            return [GenerateResponse(req.request_id, [7], [-0.1], "abort", worker.id, [VersionSpan(1, 0)])]
        return await generate(worker, req, suffix, prefill)

    provider.generate = cut_once
    await fleet.generate(request(max_tokens=3))
    assert seen == [None, 1]
    await fleet.close()


async def test_a_request_goes_to_no_worker_older_than_its_min_version():
    """k = 1 and v1 on the canary only: a request that can use v0 goes to either worker; one of a
    step whose tokens must be v1 or newer ((step - 1) - k) goes to the canary alone."""
    fleet, provider, transport, _ = await rolling("a", "b", max_lag=1)
    release = hold_health(provider, fleet, "b")
    await fleet.publish(1, transport, weights, PROBE)
    anywhere = await asyncio.gather(*(fleet.generate(request(max_tokens=3)) for _ in range(6)))
    assert {o.worker_id for (o,) in anywhere} == {"a", "b"}
    newer = await asyncio.gather(*(fleet.generate(request(max_tokens=3, min_version=1)) for _ in range(6)))
    assert {o.worker_id for (o,) in newer} == {"a"} and all(o.spans == [VersionSpan(1, 0)] for (o,) in newer)
    release.set()
    await waves_end(fleet)
    await fleet.close()


def test_a_stale_worker_is_planned_last_and_is_never_the_canary_of_every_publish():
    def worker(worker_id, version, state=WorkerState.READY):
        return WorkerInfo(id=worker_id, data_url="", admin_url="", version=version, state=state)

    workers = [worker("a", 0, WorkerState.STALE), worker("b", 1), worker("c", 1)]
    assert [[w.id for w in wave] for wave in plan_waves(workers, 1)] == [["b"], ["c"], ["a"]]


async def test_a_request_held_across_the_canarys_fence_keeps_its_tokens_while_the_probe_scores():
    """Keep pauses: a request on the canary resumes at v1 while its probe still scores, before v1
    is the fleet's; its tokens are v1's, within what the fleet installed, and not flagged."""
    fleet, provider, transport, _ = await rolling("a", step_s=0.002)

    async def slow_probe(worker, token_ids, prefill=None):
        await asyncio.sleep(0.3)
        return [-1.0]

    provider.prompt_logprobs = slow_probe
    in_flight = asyncio.create_task(fleet.generate(request(max_tokens=40)))
    await asyncio.sleep(0.02)  # dispatched at v0, generating
    publish = asyncio.create_task(fleet.publish(1, transport, weights, PROBE))
    (out,) = await in_flight
    assert [s.version for s in out.spans] == [0, 1] and out.version_error is None, out
    await publish
    await fleet.close()


async def test_a_canary_wave_whose_decode_worker_fails_is_not_passed_by_its_prefill_worker():
    """A prefill worker scores no probe: its checksum alone is no canary's agreement."""
    fleet, provider, transport, _ = await rolling("a", "b", prefill=("p1", "p2"))
    await fleet.refresh()

    async def score(worker, token_ids, prefill=None):
        return [-9.0 if worker.id == "a" else -1.0]

    provider.prompt_logprobs = score
    report = await fleet.publish(1, transport, weights, PROBE)
    canaries = [(w.wave, w.canary, "a" in w.workers, "b" in w.workers) for w in report.waves]
    assert canaries[-1][1:] == (True, False, True) and "a" in report.failed, report.waves
    assert "b" in report.ready and fleet.version == 1
    await waves_end(fleet)
    await fleet.close()


async def test_a_fleet_closed_during_the_canary_starts_no_wave_after_it():
    """The run closes while the canary's wave is under way: no later wave starts, in the
    background or otherwise, and the publish says why."""
    fleet, provider, transport, _ = await rolling("a", "b")
    release = hold_health(provider, fleet, "a")  # the canary's wave waits on its health check
    publish = asyncio.create_task(fleet.publish(1, transport, weights, PROBE))
    await asyncio.sleep(0.05)
    closing = asyncio.create_task(fleet.close())
    await asyncio.sleep(0)
    release.set()
    with pytest.raises(PublishError, match="publish v1: the fleet closed during it"):
        await publish
    await closing
    assert fleet.fence._rest is None and transport.transfers == [(["a"], 1)]  # b never fenced


async def test_a_worker_claiming_a_version_only_another_wave_was_given_is_flagged():
    """b's wave has not begun, so b holds v0; mid-request its engine labels its tokens v1, which
    only the canary was given. v1 is the fleet's version, yet not b's to claim."""
    fleet, provider, transport, _ = await rolling("a", "b", max_lag=1, step_s=0.005)
    release = hold_health(provider, fleet, "b")
    await fleet.publish(1, transport, weights, PROBE)
    fleet.routing._inflight["a"] = 100  # busy: the request goes to b
    task = asyncio.create_task(fleet.generate(request(max_tokens=20)))
    await asyncio.sleep(0.03)
    provider.engines["b"].version = 1  # behind the fleet's back
    (out,) = await task
    assert out.worker_id == "b" and out.spans[-1].version == 1
    assert "not those it was given while the request ran (v0)" in out.version_error
    assert fleet.workers["b"].state == WorkerState.STALE
    release.set()
    await waves_end(fleet)
    await fleet.close()


async def test_a_worker_claiming_the_canarys_version_while_its_probe_is_scored_is_flagged():
    """The canary has installed v1 and scores its probe (it then disagrees): no worker agreed on
    v1 anywhere, and b, never given it, claims it."""
    fleet, provider, transport, _ = await rolling("a", "b", max_lag=1, step_s=0.005)
    scored = asyncio.Event()

    async def disagrees_later(worker, token_ids, prefill=None):
        await scored.wait()
        return [-9.0]

    provider.prompt_logprobs = disagrees_later
    fleet.routing._inflight["a"] = 100  # busy: the request goes to b
    task = asyncio.create_task(fleet.generate(request(max_tokens=20)))
    await asyncio.sleep(0.02)
    publish = asyncio.create_task(fleet.publish(1, transport, weights, PROBE))
    await asyncio.sleep(0.02)
    provider.engines["b"].version = 1
    (out,) = await task
    assert out.worker_id == "b" and "not those it was given while the request ran (v0)" in out.version_error
    scored.set()
    with pytest.raises(PublishError):
        await publish
    await fleet.close()


def test_a_resumed_runs_first_publish_reaches_every_worker_as_do_its_last_and_evaluated_ones():
    """`RLRun.publish`: the trainer has a rolling publish back once its canary agreed, except the
    resume's (launched workers start at the base model), the run's last, and one evaluated."""
    from concurrent.futures import Future

    from fleetrl.app.rl import RLRun
    from fleetrl.config import Config

    asked: dict[int, bool] = {}

    class Published:
        async def publish(self, version, transport, named, probe, keep, everywhere):
            asked[version] = everywhere
            return PublishReport(version=version, seconds=0.0, checksum="c", ready=["a"])

    run = RLRun.__new__(RLRun)
    run.config = Config.model_validate({"run": {"max_steps": 6}})
    run.fleet, run.transport, run.evaluator, run.view, run.resume = Published(), None, None, None, 3
    run.fleet_started = Future()
    run.fleet_started.set_result(None)
    run.control = type("Control", (), {"run": staticmethod(asyncio.run)})()
    for step in (3, 4, 5, 6):
        run.publish(step, {"w": None}, [1, 2], [-1.0])
    assert asked == {3: True, 4: False, 5: False, 6: True}
