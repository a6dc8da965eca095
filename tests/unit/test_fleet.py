"""The fleet coordinator against an in-process fake provider: states, routing, the fence."""

import asyncio

import pytest

from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet import AgreementProbe, Fleet, PublishError, WeightSource, roster, routing
from fleetrl.inference.fleet.routing import join_completions
from fleetrl.inference.http import SINGLE_TRY
from fleetrl.inference.provider import ImpostorWorker, WorkerCallError, WorkerHeldByAnotherRun
from fleetrl.inference.types import GenerateRequest, GenerateResponse, SamplingParams, WorkerRole, WorkerState
from fleetrl.records import FenceEvent, WorkerEvent
from fleetrl.versions import VersionSpan

from .fake_fleet import FakeEngine, FakeProvider, FakeTransport


def weights():
    return iter([("w", None)])


def at_hand(source: WeightSource):
    """The start weights of attached workers (what Fleet.start awaits), loaded already."""
    async def start_weights() -> WeightSource:
        return source

    return start_weights


def request(max_tokens=20, **kw):
    return GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=max_tokens), **kw)


async def started(*ids, pause_mode="keep", step_s=0.002):
    provider = FakeProvider(*ids, step_s=step_s)
    fleet = Fleet(provider, pause_mode=pause_mode, discovery_interval_s=3600, log=lambda *_: None)
    await fleet.start()
    return fleet, provider, FakeTransport(provider)


def versions_of(tokens):
    return [t // 1000 for t in tokens]


def boundaries(tokens):
    """(version, first index) wherever the version encoded in the tokens changes."""
    vs = versions_of(tokens)
    return [(v, i) for i, v in enumerate(vs) if i == 0 or vs[i - 1] != v]


async def test_start_brings_every_worker_to_v0():
    fleet, provider, _ = await started("a", "b")
    assert {w.id: (w.state, w.version) for w in fleet.workers.values()} == {
        "a": (WorkerState.READY, 0), "b": (WorkerState.READY, 0)}
    assert all(e.version == 0 and not e.paused for e in provider.engines.values())
    (out,) = await fleet.generate(request(max_tokens=4))
    assert out.spans == [VersionSpan(0, 0)] and len(out.token_ids) == 4
    await fleet.close()


async def test_launched_workers_are_labelled_with_the_version_of_the_folder_they_loaded():
    """`fleetrl eval` of a run's checkpoint launches workers from it: they are that step's version,
    every token says so, and one restarted is labelled so again (nothing was published)."""
    provider = FakeProvider("a")
    fleet = Fleet(provider, discovery_interval_s=3600, log=lambda *_: None)
    await fleet.start(launched_version=5)
    assert fleet.version == 5 and fleet.workers["a"].version == 5 and provider.engines["a"].version == 5
    (out,) = await fleet.generate(request(max_tokens=4))
    assert out.spans == [VersionSpan(5, 0)] and out.version_error is None
    provider.engines["a"].version = None  # restarted at its address: the folder's weights, no label
    await fleet.refresh()
    await fleet.refresh()
    assert fleet.workers["a"].state == WorkerState.READY and provider.engines["a"].version == 5
    await fleet.close()


async def test_a_response_that_arrives_while_its_worker_is_resumed_is_no_fault():
    """Between resume and readmission the worker scores the agreement probe; a request that
    was in flight across the publish completes meanwhile, and comes back once the worker has
    agreed. It is a good response (spans v0 then v1, both within what the fleet published
    while it ran), not a misversioned one, not a transient error, and the worker is readmitted."""
    fleet, provider, transport = await started("a")
    scoring = asyncio.Event()

    async def slow_probe(worker, ids, prefill=None):
        scoring.set()
        await asyncio.sleep(0.2)  # the in-flight request finishes while the worker is UPDATING
        return [-1.0]

    provider.prompt_logprobs = slow_probe
    task = asyncio.create_task(fleet.generate(request(max_tokens=40, n=1)))
    await asyncio.sleep(0.02)
    publish = asyncio.create_task(fleet.publish(1, transport, weights, AgreementProbe([1, 2], [-1.0])))
    await scoring.wait()
    (out,) = await task
    assert fleet.workers["a"].state == WorkerState.READY  # held until its worker agreed
    report = await publish
    assert out.version_error is None and [s.version for s in out.spans] == [0, 1]
    assert report.ready == ["a"] and not report.failed and fleet.transient_errors == 0
    assert fleet.workers["a"].state == WorkerState.READY
    await fleet.close()


async def test_attached_workers_are_held_to_the_base_checksum_before_they_are_v0():
    """Attached workers (started by someone else) are labelled v0 only once they hold the base
    weights: one a previous run left at v5, or one that never received any (fleetrl cannot know
    what it loaded), is refitted with them; one at the base already is not sent them again."""
    provider = FakeProvider("left-at-v5", "fresh", "at-base", launches_workers=False)
    provider.engines["left-at-v5"].version, provider.engines["left-at-v5"].checksum = 5, "sum-v5"
    provider.engines["at-base"].version, provider.engines["at-base"].checksum = 0, "sum-v0"
    logs = []
    fleet = Fleet(provider, discovery_interval_s=3600, log=logs.append)
    with pytest.raises(FleetrlError, match="needs the run's base weights"):
        await fleet.start()
    transport = FakeTransport(provider)
    await fleet.start(at_hand(WeightSource(transport, weights, "sum-v0", None, version=0)))
    assert sorted(ids for ids, _ in transport.transfers) == [["fresh"], ["left-at-v5"]]
    assert {i: e.abandoned for i, e in provider.engines.items()} == {"left-at-v5": 1, "fresh": 1, "at-base": 0}
    assert all(e.version == 0 and e.checksum == "sum-v0" and not e.paused for e in provider.engines.values())
    assert all(w.state == WorkerState.READY and w.version == 0 for w in fleet.workers.values())
    assert fleet.checksum == "sum-v0"
    assert any("left-at-v5 reports version 5, not v0: refitting it" in line for line in logs), logs
    # A wrong install of the base weights (checksum right, logprobs not) never serves.
    provider.add("wrong-install").version = 0
    provider.engines["wrong-install"].checksum = "sum-v0"
    fleet.fence.source.probe = AgreementProbe([1, 2], [-1.0])
    provider.prompt_logprobs = lambda worker, ids, prefill=None: asyncio.sleep(0, [-1.0 if worker.id != "wrong-install" else -3.0])
    await fleet.refresh()
    assert fleet.workers["wrong-install"].state == WorkerState.STALE
    assert "agreement probe" in fleet.workers["wrong-install"].error
    await fleet.close()


async def test_a_resumed_run_holds_attached_workers_to_the_checkpoints_version_sending_only_what_they_lack():
    """A resumed run starts the fleet at its checkpoint's version: a worker the killed run left
    there (version and checksum) is sent nothing; one at another version is refitted once, to
    the checkpoint's weights, never to the base first."""
    provider = FakeProvider("left-at-v4", "left-at-v5", launches_workers=False)
    for worker_id, version in (("left-at-v4", 4), ("left-at-v5", 5)):
        provider.engines[worker_id].version, provider.engines[worker_id].checksum = version, f"sum-v{version}"
    fleet = Fleet(provider, discovery_interval_s=3600, log=lambda line: None)
    transport = FakeTransport(provider)
    await fleet.start(at_hand(WeightSource(transport, weights, "sum-v4", None, version=4)))
    assert fleet.version == 4 and fleet.checksum == "sum-v4"
    assert [(ids, version) for ids, version in transport.transfers] == [(["left-at-v5"], 4)]
    assert all(e.version == 4 and e.checksum == "sum-v4" and not e.paused for e in provider.engines.values())
    assert all(w.state == WorkerState.READY and w.version == 4 for w in fleet.workers.values())
    report = await fleet.publish(5, transport, weights)
    assert sorted(report.ready) == ["left-at-v4", "left-at-v5"] and fleet.version == 5
    await fleet.close()


async def test_publish_reaches_every_worker_and_resumes():
    fleet, provider, transport = await started("a", "b")
    report = await fleet.publish(1, transport, weights)
    assert sorted(report.ready) == ["a", "b"] and not report.failed
    assert report.checksum == "sum-v1" and fleet.version == 1
    assert all(e.version == 1 and not e.paused for e in provider.engines.values())
    assert all(w.state == WorkerState.READY and w.version == 1 for w in fleet.workers.values())
    with pytest.raises(PublishError, match="already at v1"):
        await fleet.publish(1, transport, weights)
    await fleet.close()


async def test_the_fleet_tells_of_every_state_change_and_fence():
    """What the run's events file (and its timeline) is made of, in order, and each ready
    worker's time in the publish."""
    fleet, provider, transport = await started("a", "b")
    events = []
    fleet.on_event = events.append
    transport.corrupt_worker = "b"
    report = await fleet.publish(1, transport, weights)
    assert events[0].model_copy(update=dict(t=0)) == FenceEvent(phase="start", version=1, t=0)
    assert events[-1].model_copy(update=dict(t=0)) == FenceEvent(phase="end", version=1, ready=["a"], t=0)
    states = {w: [(e.state, e.version) for e in events if isinstance(e, WorkerEvent) and e.worker == w]
              for w in ("a", "b")}
    assert states == {"a": [("paused", 0), ("updating", 0), ("ready", 1)], "b": [("paused", 0), ("updating", 0), ("stale", 0)]}
    assert "checksum" in next(e.error for e in events if isinstance(e, WorkerEvent) and e.state == "stale")
    assert list(report.worker_seconds) == ["a"] and 0 < report.worker_seconds["a"] <= report.seconds
    await fleet.close()
    fleet, provider, transport = await started("a")
    fleet.on_event = events.append
    transport.corrupt_worker = "a"
    with pytest.raises(PublishError):  # a fence that fails still ends, with no worker ready
        await fleet.publish(1, transport, weights)
    assert events[-1].model_copy(update=dict(t=0)) == FenceEvent(phase="end", version=1, ready=[], t=0)
    await fleet.close()


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_request_in_flight_gets_exact_spans(mode):
    fleet, provider, transport = await started("a", pause_mode=mode)
    task = asyncio.create_task(fleet.generate(request(max_tokens=60)))
    await asyncio.sleep(0.03)  # some tokens at v0
    await fleet.publish(1, transport, weights)
    (out,) = await task
    assert len(out.token_ids) == 60
    expected = [VersionSpan(v, i) for v, i in boundaries(out.token_ids)]
    assert out.spans == expected and [s.version for s in out.spans] == [0, 1]
    assert min(span.version for span in out.spans) == 0
    await fleet.close()


async def test_worker_that_fails_to_pause_is_dead_and_the_rest_complete():
    fleet, provider, transport = await started("a", "b")
    provider.engines["b"].fail.add("pause")
    report = await fleet.publish(1, transport, weights)
    assert report.ready == ["a"] and "b" in report.failed and "injected" in report.failed["b"]
    assert fleet.workers["b"].state == WorkerState.DEAD
    outs = await asyncio.gather(*(fleet.generate(request(max_tokens=3)) for _ in range(6)))
    assert {o.worker_id for (o,) in outs} == {"a"}
    await fleet.close()


async def test_a_worker_whose_fence_step_was_cancelled_under_it_is_left_out():
    """gather(return_exceptions=True) hands back a step cancelled from inside as a CancelledError,
    which is no Exception: it must fail the worker, never count as its pass."""
    fleet, provider, transport = await started("a", "b")

    async def step(worker) -> None:
        if worker.id == "b":
            raise asyncio.CancelledError  # as an inner task another party cancelled

    failed: dict[str, str] = {}
    ok = await fleet.roster.each(sorted(fleet.workers.values(), key=lambda w: w.id), step, failed, WorkerState.DEAD)
    assert [w.id for w in ok] == ["a"] and failed == {"b": "CancelledError"}
    assert fleet.workers["b"].state == WorkerState.DEAD
    await fleet.close()


async def test_worker_that_breaks_the_transfer_is_dropped_and_the_rest_retried():
    fleet, provider, transport = await started("a", "b")
    transport.fail_worker = "a"
    report = await fleet.publish(1, transport, weights)
    assert report.ready == ["b"] and "update_weights failed" in report.failed["a"]
    assert transport.transfers == [(["a", "b"], 1), (["b"], 1)]
    assert fleet.workers["a"].state == WorkerState.DEAD
    await fleet.close()


async def test_peer_that_dies_mid_transfer_is_dropped_even_when_a_survivor_reports_the_error():
    # In a collective the survivor's "connection reset" surfaces first and names the survivor.
    fleet, provider, transport = await started("a", "b")
    transport.kill_worker = "b"
    report = await fleet.publish(1, transport, weights)
    assert report.ready == ["a"] and "connection reset" in report.failed["b"]
    assert transport.transfers == [(["a", "b"], 1), (["a"], 1)]
    assert fleet.workers["b"].state == WorkerState.DEAD and fleet.workers["a"].state == WorkerState.READY
    await fleet.close()


async def test_wrong_checksum_leaves_worker_stale_and_paused():
    fleet, provider, transport = await started("a", "b")
    transport.corrupt_worker = "b"
    report = await fleet.publish(1, transport, weights)
    assert report.ready == ["a"] and "checksum" in report.failed["b"]
    assert fleet.workers["b"].state == WorkerState.STALE
    assert provider.engines["b"].paused  # never resumed with a version the fleet cannot vouch for
    outs = await asyncio.gather(*(fleet.generate(request(max_tokens=3)) for _ in range(4)))
    assert {o.worker_id for (o,) in outs} == {"a"} and all(o.spans == [VersionSpan(1, 0)] for (o,) in outs)
    # The next discovery round refits the stale worker to the fleet's version.
    transport.corrupt_worker = None
    await fleet.refresh()
    assert fleet.workers["b"].state == WorkerState.READY and provider.engines["b"].checksum == "sum-v1"
    await fleet.close()


async def test_publish_that_completes_nowhere_raises_and_resumes_nothing():
    fleet, provider, transport = await started("a")
    transport.corrupt_worker = "a"
    with pytest.raises(PublishError, match="completed on no worker"):
        await fleet.publish(1, transport, weights)
    assert fleet.version == 0 and provider.engines["a"].paused
    await fleet.close()


async def test_joining_worker_is_refitted_before_it_serves():
    fleet, provider, transport = await started("a")
    await fleet.publish(1, transport, weights)
    late = provider.add("late")
    assert late.version is None
    await fleet.refresh()
    assert late.version == 1 and late.checksum == "sum-v1" and not late.paused
    assert transport.transfers[-1] == (["late"], 1)
    assert fleet.workers["late"].state == WorkerState.READY
    await fleet.close()


async def test_weights_not_kept_past_their_publish_refit_late_workers_at_the_next_publish():
    """A CUDA trainer streams a version from its shards during the publish and keeps no copy
    (keep=False): the publish may still retry, but a worker that joins, or is found stale,
    afterwards gets nothing sent; it serves nothing until the next publish brings it in."""
    fleet, provider, transport = await started("a", "b")
    transport.fail_worker = "b"
    report = await fleet.publish(1, transport, weights, keep=False)
    assert report.ready == ["a"] and transport.transfers == [(["a", "b"], 1), (["a"], 1)]  # retried in the publish
    transport.fail_worker = None
    late = provider.add("late")
    provider.engines["a"].version = 0  # restarted at the same URL, found at the next round
    await fleet.refresh()
    await fleet.refresh()
    assert transport.transfers == [(["a", "b"], 1), (["a"], 1)]  # nothing sent between publishes
    # The dead one answers its health check again: it too waits.
    assert all(w.state == WorkerState.STALE and "waits for the next publish" in w.error
               for w in fleet.workers.values())
    assert late.paused and fleet.routable_workers() == []  # none serves a request
    report = await fleet.publish(2, transport, weights, keep=False)
    assert sorted(report.ready) == ["a", "b", "late"] and transport.transfers[-1] == (["a", "b", "late"], 2)
    assert all(w.state == WorkerState.READY and w.version == 2 for w in fleet.workers.values())
    await fleet.close()


async def test_vanished_worker_is_dead_and_no_worker_at_all_is_an_error():
    fleet, provider, _ = await started("a")
    provider.engines["a"].alive = False
    await fleet.refresh()
    assert fleet.workers["a"].state == WorkerState.DEAD
    with pytest.raises(FleetrlError, match="no live inference worker"):
        await fleet.generate(request())
    await fleet.close()


async def test_requests_spread_by_load_and_stick_by_session():
    fleet, provider, _ = await started("a", "b")
    await asyncio.gather(*(fleet.generate(request(max_tokens=5)) for _ in range(8)))
    assert provider.engines["a"].served == provider.engines["b"].served == 4
    sticky = [await fleet.generate(request(max_tokens=2, session_id="s1")) for _ in range(4)]
    assert len({o.worker_id for (o,) in sticky}) == 1
    await fleet.close()


async def test_the_session_map_forgets_the_least_recently_used_sessions(monkeypatch):
    monkeypatch.setattr(routing, "STICKY_SESSIONS", 2)
    fleet, _, _ = await started("a", "b")
    for session in ["s1", "s2", "s1", "s3"]:
        await fleet.generate(request(max_tokens=2, session_id=session))
    assert list(fleet.routing._sticky) == ["s1", "s3"]  # s2 was used least recently
    await fleet.close()


async def test_response_at_a_version_the_fleet_never_published_is_flagged():
    fleet, provider, _ = await started("a", "b")
    provider.engines["a"].version = 7  # a worker that changed weights behind the fleet's back
    outs = [o for (o,) in await asyncio.gather(*(fleet.generate(request(max_tokens=2)) for _ in range(2)))]
    (bad,) = [o for o in outs if o.worker_id == "a"]
    (good,) = [o for o in outs if o.worker_id == "b"]
    assert "not those it was given while the request ran (v0)" in bad.version_error and good.version_error is None
    assert fleet.workers["a"].state == WorkerState.STALE
    # A stale worker takes no more requests.
    outs = await asyncio.gather(*(fleet.generate(request(max_tokens=2)) for _ in range(3)))
    assert {o.worker_id for (o,) in outs} == {"b"}
    await fleet.close()


def test_join_completions_shifts_spans():
    head = GenerateResponse("r", [1, 2, 3], [0.0] * 3, "abort", "a", [VersionSpan(0, 0), VersionSpan(1, 2)])
    tail = GenerateResponse("r", [4, 5], [0.0] * 2, "length", "b", [VersionSpan(1, 0), VersionSpan(2, 1)])
    joined = join_completions(head, tail)
    assert joined.token_ids == [1, 2, 3, 4, 5]
    assert joined.spans == [VersionSpan(0, 0), VersionSpan(1, 2), VersionSpan(2, 4)]
    assert joined.finish_reason == "length" and joined.worker_id == "a+b"


async def test_request_on_a_worker_that_dies_is_retried_elsewhere():
    fleet, provider, _ = await started("a", "b", step_s=0.01)
    first = asyncio.create_task(fleet.generate(request(max_tokens=30, session_id="s")))
    await asyncio.sleep(0.05)
    victim = fleet.routing._sticky["s"]
    provider.engines[victim].alive = False
    (out,) = await first
    assert out.worker_id != victim and len(out.token_ids) == 30
    assert fleet.workers[victim].state == WorkerState.DEAD
    await fleet.close()


async def test_requests_go_to_decode_workers_prefilled_by_ready_prefill_workers():
    fleet, provider, _ = await started("d")
    provider.add("p", WorkerRole.PREFILL)
    provider.add("q", WorkerRole.PREFILL).fail.add("set_version")  # can never be brought to v0
    await fleet.refresh()
    assert fleet.workers["p"].state == WorkerState.READY and fleet.workers["q"].state == WorkerState.STALE
    assert [w.id for w in fleet.routable_workers()] == ["d"]
    outs = await asyncio.gather(*(fleet.generate(request(max_tokens=3)) for _ in range(4)))
    assert all(o.worker_id == "d" for (o,) in outs)
    assert (provider.engines["p"].prefilled, provider.engines["q"].prefilled) == (4, 0)


async def test_a_prefill_worker_that_dies_under_a_request_is_dropped_and_the_request_served():
    fleet, provider, _ = await started("d")
    provider.add("p", WorkerRole.PREFILL)
    await fleet.refresh()
    provider.engines["p"].alive = False
    (out,) = await fleet.generate(request(max_tokens=3))
    assert out.worker_id == "d" and fleet.workers["p"].state == WorkerState.DEAD


# -- faults: hung, restarted and flaky workers (issue 10) ----------------------------------


def test_a_hung_worker_leaves_the_fence_after_one_health_timeout():
    async def scenario():
        fleet, provider, transport = await started("a", "b")
        fleet.health_timeout_s = 0.2

        async def never_answers():
            await asyncio.Event().wait()  # SIGSTOPped: the socket is open, nothing answers

        provider.admin(fleet.workers["b"]).health = never_answers
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        report = await fleet.publish(1, transport, weights)
        took = loop.time() - t0
        assert report.ready == ["a"] and "health check" in report.failed["b"]
        assert fleet.workers["b"].state == WorkerState.DEAD
        assert transport.transfers == [(["a"], 1)]  # the hung worker was never part of the transfer
        assert took < 5  # one timeout, not the admin calls' timeouts and retries
        # The next discovery round does not try to refit it while it stays hung.
        await fleet.refresh()
        assert fleet.workers["b"].state == WorkerState.DEAD and transport.transfers == [(["a"], 1)]

    asyncio.run(scenario())


def test_a_worker_restarted_with_base_weights_is_found_stale_and_refitted():
    async def scenario():
        fleet, provider, transport = await started("a", "b")
        await fleet.publish(1, transport, weights)
        provider.engines["b"].version, provider.engines["b"].checksum = 0, None  # restarted at the same URL
        await fleet.refresh()
        assert fleet.workers["b"].state == WorkerState.STALE
        assert "reports version 0 but was verified at v1" in fleet.workers["b"].error
        (out,) = await fleet.generate(request(max_tokens=3, n=1))
        assert out.worker_id == "a"  # the stale worker serves nothing
        await fleet.refresh()
        assert fleet.workers["b"].state == WorkerState.READY and provider.engines["b"].version == 1
        assert transport.transfers[-1] == (["b"], 1)

    asyncio.run(scenario())


def test_a_transient_error_of_a_healthy_worker_is_retried_on_another():
    async def scenario():
        fleet, provider, transport = await started("a", "b")
        real = provider.generate
        calls = []

        async def flaky(worker, request, suffix=(), prefill=None):
            calls.append(worker.id)
            if len(calls) == 1:
                raise KeyError("choices")  # a malformed 200
            return await real(worker, request, suffix, prefill)

        provider.generate = flaky
        (out,) = await fleet.generate(request(max_tokens=3, n=1))
        assert len(calls) == 2 and calls[0] != calls[1] and out.worker_id == calls[1]
        assert fleet.transient_errors == 1
        assert all(w.state == WorkerState.READY for w in fleet.workers.values())

        async def always_fails(worker, request, suffix=(), prefill=None):
            raise FleetrlError(f"worker {worker.id}: HTTP 500")

        provider.generate = always_fails
        with pytest.raises(FleetrlError, match="HTTP 500"):
            await fleet.generate(request(max_tokens=3, n=1))
        assert fleet.transient_errors == 1 + routing.TRANSIENT_RETRIES

    asyncio.run(scenario())


def test_continuing_an_aborted_completion_has_a_cap():
    async def scenario():
        fleet, provider, transport = await started("a")

        async def always_cut(worker, request, suffix=(), prefill=None):
            return [GenerateResponse(request.request_id, [7], [-0.1], "abort", worker.id, [VersionSpan(0, 0)])]

        provider.generate = always_cut
        with pytest.raises(FleetrlError, match=f"cut by {routing.MAX_CONTINUATIONS} publishes"):
            await fleet.generate(request(max_tokens=100, n=1))

    asyncio.run(scenario())


def test_no_ready_worker_for_too_long_ends_the_wait_naming_each_worker():
    async def scenario():
        provider = FakeProvider("a", "b")
        fleet = Fleet(provider, discovery_interval_s=0.05, no_worker_timeout_s=0.5, log=lambda *_: None)
        await fleet.start()
        for engine in provider.engines.values():
            engine.fail.add("pause")  # every refit fails: the workers stay stale
            engine.version = 7
        await fleet.refresh()
        assert all(w.state == WorkerState.STALE for w in fleet.workers.values())
        with pytest.raises(FleetrlError, match=r"no inference worker has been ready for 0.5 s.*a \(stale.*b \(stale"):
            await asyncio.wait_for(fleet.generate(request(max_tokens=3, n=1)), timeout=10)
        await fleet.close()

    asyncio.run(scenario())


def test_a_dead_launched_worker_is_restarted_within_the_budget_and_refitted():
    async def scenario():
        provider = FakeProvider("a", "b")
        fleet = Fleet(provider, discovery_interval_s=3600, max_restarts=1, log=lambda *_: None)
        await fleet.start()
        transport = FakeTransport(provider)
        await fleet.publish(1, transport, weights)
        restarted = []

        async def restart(worker):
            restarted.append(worker.id)
            provider.engines[worker.id] = FakeEngine(worker.id)  # base weights, no version
            return worker.id

        provider.restart = restart
        provider.engines["b"].alive = False
        await fleet.refresh()  # gone from discovery: dead, and restarted
        await asyncio.sleep(0)
        assert restarted == ["b"] and fleet.restarts_left == 0
        await fleet.refresh()  # back: refitted to v1 before it serves
        assert fleet.workers["b"].state == WorkerState.READY and provider.engines["b"].version == 1
        assert transport.transfers[-1] == (["b"], 1)
        provider.engines["b"].alive = False
        await fleet.refresh()
        await asyncio.sleep(0)
        assert restarted == ["b"] and fleet.workers["b"].state == WorkerState.DEAD  # the budget is spent
        await fleet.close()

    asyncio.run(scenario())


def test_no_worker_is_restarted_once_the_fleet_closes():
    async def scenario():
        provider = FakeProvider("a")
        fleet = Fleet(provider, discovery_interval_s=3600, max_restarts=3, log=lambda *_: None)
        await fleet.start()
        restarted = []

        async def restart(worker):
            restarted.append(worker.id)
            return worker.id

        provider.restart = restart
        await fleet.close()
        provider.engines["a"].alive = False  # its process stopped with the fleet
        fleet.roster.mark(fleet.workers["a"], WorkerState.DEAD, "gone")
        await asyncio.sleep(0)
        assert restarted == []

    asyncio.run(scenario())


def test_workers_that_die_together_share_the_restart_budget():
    async def scenario():
        provider = FakeProvider("a", "b")
        fleet = Fleet(provider, discovery_interval_s=3600, max_restarts=1, log=lambda *_: None)
        await fleet.start()
        restarted = []

        async def restart(worker):
            await asyncio.sleep(0.01)  # a process start takes a while: both deaths are seen first
            restarted.append(worker.id)
            return worker.id

        provider.restart = restart
        for engine in provider.engines.values():
            engine.alive = False
        await fleet.refresh()
        await asyncio.sleep(0.05)
        assert len(restarted) == 1 and fleet.restarts_left == 0
        await fleet.close()

    asyncio.run(scenario())


def restarts_with_base_weights(provider):
    """provider.restart as a launcher's: a new engine at the same address, base weights, no label."""
    restarted = []

    async def restart(worker):
        restarted.append(worker.id)
        provider.engines[worker.id] = FakeEngine(worker.id)
        return worker.id

    provider.restart = restart
    return restarted


def test_the_one_worker_that_dies_is_waited_for_and_serves_again_after_its_restart():
    """The default fleet (one worker, inference.max_restarts = 3) once ended the run as soon as
    its worker died, restart or not: "no live inference worker". A request and a publish now
    wait for the restart (at most no_worker_timeout_s), and go on at the fleet's version."""
    async def scenario():
        provider = FakeProvider("a", step_s=0.01)
        fleet = Fleet(provider, discovery_interval_s=0.05, max_restarts=3, no_worker_timeout_s=60,
                      log=lambda *_: None)
        await fleet.start()
        transport = FakeTransport(provider)
        await fleet.publish(1, transport, weights)
        restarted = restarts_with_base_weights(provider)
        in_flight = asyncio.create_task(fleet.generate(request(max_tokens=50)))
        await asyncio.sleep(0.1)
        provider.engines["a"].alive = False  # dies under the request
        (out,) = await asyncio.wait_for(in_flight, 30)
        assert restarted == ["a"] and out.spans == [VersionSpan(1, 0)] and len(out.token_ids) == 50
        provider.engines["a"].alive = False  # dies again, and a publish comes while it restarts
        await fleet.refresh()
        report = await asyncio.wait_for(fleet.publish(2, transport, weights), 30)
        assert restarted == ["a", "a"] and report.ready == ["a"] and provider.engines["a"].version == 2
        await fleet.close()

    asyncio.run(scenario())


def test_with_no_restart_left_a_fleet_without_a_live_worker_fails_at_once():
    async def scenario():
        provider = FakeProvider("a")
        fleet = Fleet(provider, discovery_interval_s=0.05, max_restarts=0, no_worker_timeout_s=60,
                      log=lambda *_: None)
        await fleet.start()
        provider.engines["a"].alive = False
        await fleet.refresh()
        with pytest.raises(FleetrlError, match="^no live inference worker: a "):
            await asyncio.wait_for(fleet.generate(request()), 5)
        await fleet.close()

    asyncio.run(scenario())


def test_a_worker_a_listing_misses_once_while_it_answers_is_not_replaced():
    """A listing can miss a live worker for a moment (a Dynamo discovery entry refreshed late).
    Such a worker was killed and replaced at once; now its health is checked first: one that
    answers is out of routing for the round and refitted when the next listing has it again,
    and replaced only if that listing misses it too (issue 36, item 9)."""
    async def scenario():
        provider = FakeProvider("a", "b")
        fleet = Fleet(provider, discovery_interval_s=3600, max_restarts=1, log=lambda *_: None)
        await fleet.start()
        await fleet.publish(1, FakeTransport(provider), weights)
        restarted = restarts_with_base_weights(provider)
        hidden = set()
        listed = provider.discover

        async def discover():
            return [w for w in await listed() if w.id not in hidden]

        provider.discover = discover
        hidden.add("b")
        await fleet.refresh()  # missed once, answers its health check
        await asyncio.sleep(0.01)
        assert restarted == [] and fleet.workers["b"].state == WorkerState.DEAD and fleet.restart_pending()
        hidden.clear()
        await fleet.refresh()  # listed again: refitted, never replaced
        assert restarted == [] and fleet.workers["b"].state == WorkerState.READY
        assert provider.engines["b"].version == 1
        hidden.add("b")
        await fleet.refresh()
        await fleet.refresh()  # missed twice in a row: replaced
        await asyncio.sleep(0.01)
        assert restarted == ["b"] and fleet.workers["b"].error == "gone from two discovery rounds in a row"
        await fleet.close()

    asyncio.run(scenario())


def test_a_fleet_whose_replacement_died_too_fails_at_once():
    """A Dynamo worker's replacement is a new instance. The replaced id stayed awaited for good,
    so a fleet whose every worker then died waited inference.no_worker_timeout_s (600 s) for it
    instead of failing (issue 36, item 9): a replacement is awaited only until discovery finds it."""
    async def scenario():
        provider = FakeProvider("a")
        fleet = Fleet(provider, discovery_interval_s=3600, max_restarts=1, no_worker_timeout_s=600,
                      log=lambda *_: None)
        await fleet.start()

        async def restart(worker):
            provider.add("a2")  # a new process is a new instance
            return "a2"

        provider.restart = restart
        provider.engines["a"].alive = False
        await fleet.refresh()
        while fleet.lifecycle._restarts:
            await asyncio.sleep(0.01)
        assert fleet.restart_pending() and "a2" not in fleet.workers  # up, not yet discovered: waited for
        await fleet.refresh()
        assert fleet.workers["a2"].state == WorkerState.READY and not fleet.restart_pending()
        provider.engines["a2"].alive = False  # no restart left
        await fleet.refresh()
        with pytest.raises(FleetrlError, match="^no live inference worker: a \\(dead: gone from discovery\\); a2 "):
            await asyncio.wait_for(fleet.generate(request()), 10)
        await fleet.close()

    asyncio.run(scenario())


def test_a_worker_restarted_behind_the_fleets_back_is_refitted_and_the_request_sent_again():
    """Started again at its address before the fleet noticed: it labels its tokens "default".
    That once failed every request sent to it until the run ended; now the worker is stale, the
    discovery loop refits it, and the request is served at the fleet's version."""
    async def scenario():
        provider = FakeProvider("a")
        fleet = Fleet(provider, discovery_interval_s=0.05, log=lambda *_: None)
        await fleet.start()
        await fleet.publish(1, FakeTransport(provider), weights)
        provider.engines["a"] = FakeEngine("a")  # still ready, for the fleet
        (out,) = await asyncio.wait_for(fleet.generate(request(max_tokens=8)), 30)
        assert out.spans == [VersionSpan(1, 0)] and provider.engines["a"].version == 1
        assert fleet.workers["a"].state == WorkerState.READY
        await fleet.close()

    asyncio.run(scenario())


async def test_tokens_of_a_worker_that_then_fails_the_probe_are_never_trained():
    """Keep mode: a request held across the publish runs on as soon as its worker resumes,
    before the worker scores the probe. Its tokens at v1 were once trained as v1 though the
    worker then failed the probe (weights received but not installed as sent). Now a response
    that comes back while the probe is scored waits for its verdict, and is flagged."""
    fleet, provider, transport = await started("a", step_s=0.005)
    scoring = asyncio.Event()

    async def wrong_install(worker, ids, prefill=None):
        scoring.set()
        await asyncio.sleep(0.3)  # the held request finishes while its worker is scored
        return [-3.0]

    provider.prompt_logprobs = wrong_install
    held = asyncio.create_task(fleet.generate(request(max_tokens=40)))
    await asyncio.sleep(0.02)
    publish = asyncio.create_task(fleet.publish(1, transport, weights, AgreementProbe([1, 2], [-1.0])))
    await scoring.wait()
    report = await publish
    (out,) = await held
    assert [s.version for s in out.spans] == [0, 1] and "a" in report.failed
    assert out.version_error == (f"worker a failed the agreement probe at v1 ({report.failed['a']}): its tokens at v1 "
                                 "are not trained")
    assert fleet.workers["a"].state == WorkerState.STALE
    await fleet.close()


async def test_a_failed_probe_verdict_flags_only_the_requests_sent_before_the_refit_that_agreed():
    """The worker fails the probe at v1 while a request is held across the publish (keep mode);
    a discovery round then refits it at v1, and it agrees. The held request's tokens at v1 came
    partly from the weights that failed: the later verdict must not replace the failed one
    (it did, and the response was trained). A request sent after that refit holds none of them:
    the failed verdict was once kept for the version, every later answer at v1 was flagged, and a
    one-worker run ended on "batch N is empty: 32 were misversioned" (issue 36, item 3)."""
    fleet, provider, transport = await started("a", step_s=0.005)
    scores = iter([[-3.0], [-1.0]])  # the publish's install is wrong, the refit's right

    async def score(worker, ids, prefill=None):
        return next(scores)

    provider.prompt_logprobs = score
    held = asyncio.create_task(fleet.generate(request(max_tokens=400)))
    await asyncio.sleep(0.05)
    report = await fleet.publish(1, transport, weights, AgreementProbe([1, 2], [-1.0]))
    assert "a" in report.failed and fleet.workers["a"].state == WorkerState.STALE
    await fleet.refresh()  # the refit at v1, which agrees
    assert fleet.workers["a"].state == WorkerState.READY and not held.done()
    for _ in range(3):
        (later,) = await fleet.generate(request(max_tokens=4))
        assert later.spans == [VersionSpan(1, 0)] and later.version_error is None
    assert not held.done()
    (out,) = await held
    assert [s.version for s in out.spans] == [0, 1]
    assert out.version_error is not None and "failed the agreement probe at v1" in out.version_error
    await fleet.close()


async def test_a_slow_discovery_round_never_holds_a_publish_back(monkeypatch):
    """Discovery (an etcd read with its own retries, say) answers before the round takes the
    publish fence, and the version check under it is bounded by health_timeout_s, not by the
    admin client's retries: a publish waits for neither (issue 27, item 11)."""
    fleet, provider, transport = await started("a", "b")
    fleet.health_timeout_s = 0.2
    discovering, answer = asyncio.Event(), asyncio.Event()
    discover = provider.discover

    async def slow_discover():
        discovering.set()
        await answer.wait()
        return await discover()

    monkeypatch.setattr(provider, "discover", slow_discover)
    round_ = asyncio.create_task(fleet.refresh())
    await discovering.wait()
    report = await asyncio.wait_for(fleet.publish(1, transport, weights), 5)  # not behind the round
    assert sorted(report.ready) == ["a", "b"]
    answer.set()
    await round_

    version, calls = provider.admin(fleet.workers["a"]).version, []

    async def retrying_version():  # the round's check: an admin client going through its retries
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(60)
        return await version()

    monkeypatch.setattr(provider.admin(fleet.workers["a"]), "version", retrying_version)
    round_ = asyncio.create_task(fleet.refresh())
    await asyncio.sleep(0.05)
    report = await asyncio.wait_for(fleet.publish(2, transport, weights), 5)  # held at most ~0.2 s
    assert sorted(report.ready) == ["a", "b"]
    await asyncio.wait_for(round_, 5)
    await fleet.close()


async def test_the_discovery_rounds_refits_try_each_admin_call_once_and_the_starts_keep_the_retries(monkeypatch):
    """A round's refit holds the publish fence: its admin calls are tried once (http.SINGLE_TRY),
    so a worker that does not answer holds a publish back for one timeout, not for every retry.
    The start's refits, which no publish waits for, keep them (issue 27, item 11)."""
    provider = FakeProvider("a")
    fleet = Fleet(provider, discovery_interval_s=0.02, log=lambda *_: None)
    (worker,) = await provider.discover()
    pauses = []
    pause = provider.admin(worker).pause

    async def recorded(mode):
        pauses.append(SINGLE_TRY.get())
        await pause(mode)

    monkeypatch.setattr(provider.admin(worker), "pause", recorded)
    await fleet.start()
    provider.add("b")
    (joining,) = [w for w in await provider.discover() if w.id == "b"]
    monkeypatch.setattr(provider.admin(joining), "pause", recorded)
    for _ in range(200):
        if len(pauses) == 2:
            break
        await asyncio.sleep(0.01)
    assert pauses == [False, True]  # a's refit at start, b's in a discovery round
    assert not SINGLE_TRY.get()  # the round's setting stays in the discovery task
    await fleet.close()


async def test_an_attached_worker_that_cannot_say_what_it_holds_is_refused_before_it_is_paused(monkeypatch):
    """Dynamo's own worker started as plain `python -m dynamo.vllm` answers the weight check with
    a bare "ok": it could never be verified, so it is refused before any refit (it used to be
    paused and sent the weights, then fail the check) (issue 27, item 5)."""
    provider = FakeProvider("plain", "ours", launches_workers=False)
    for engine in provider.engines.values():
        engine.checksum, engine.pause_mode = "base", "never paused"
    logged = []
    fleet = Fleet(provider, discovery_interval_s=3600, log=logged.append)
    plain = next(w for w in await provider.discover() if w.id == "plain")
    admin = provider.admin(plain)

    async def proves_nothing():
        raise WorkerCallError("plain", "weight check", "the worker answered without its ranks' checksums, which "
                              "proves nothing: run it with `python -m fleetrl.engine.dynamo_worker`")

    monkeypatch.setattr(admin, "weight_state", proves_nothing)
    transport = FakeTransport(provider)
    await fleet.start(at_hand(WeightSource(transport, weights, "base", None, 0)))
    await fleet.refresh()  # and at every round after: a stale worker is refitted, not let in
    assert fleet.workers["plain"].state == WorkerState.STALE and fleet.workers["ours"].state == WorkerState.READY
    assert "which proves nothing" in fleet.workers["plain"].error
    assert provider.engines["plain"].pause_mode == "never paused"
    await fleet.close()


async def test_an_impostor_at_a_workers_address_is_dead_at_the_next_discovery_round(monkeypatch):
    """A process that took a ready worker's port answers /health; the fleet's health check is
    signed, and an answer without the worker's proof (ImpostorWorker) takes the worker out of
    the fleet, naming why (it stayed ready, and its tokens could be trained)."""
    logged = []
    provider = FakeProvider("a", "b")
    fleet = Fleet(provider, discovery_interval_s=3600, log=logged.append)
    await fleet.start()

    async def impostor():
        raise ImpostorWorker("a", "GET /health", "it answered (HTTP 200: '') without proof that it holds the run's "
                             "admin token")

    monkeypatch.setattr(provider.admin(fleet.workers["a"]), "health", impostor)
    await fleet.refresh()
    assert fleet.workers["a"].state == WorkerState.DEAD and fleet.workers["b"].state == WorkerState.READY
    assert any("worker a" in line and "without proof that it holds the run's admin token" in line for line in logged)
    assert all(out.worker_id == "b" for out in await fleet.generate(request(max_tokens=2, n=4)))
    await fleet.close()


async def test_a_worker_that_announces_another_live_workers_instance_is_kept_out_in_one_line():
    """Two spellings of one server (127.0.0.1 and 127.1, say), or a relay on a dead worker's
    address to a live one (Dynamo's handlers see no address): the worker announces the server
    instance another live worker announced first, and is kept out, said once (issue 36, item 5)."""
    provider = FakeProvider("a", "b")
    provider.engines["b"].instance = provider.engines["a"].instance
    logged: list[str] = []
    fleet = Fleet(provider, discovery_interval_s=3600, log=logged.append)
    await fleet.start()
    await fleet.refresh()
    assert fleet.workers["a"].state == WorkerState.READY and fleet.workers["b"].state == WorkerState.STALE
    assert [line for line in logged if "worker b" in line] == [
        "fleetrl: worker b is stale: worker b: its health check failed: it announces the server instance of "
        "worker a: the same server under another address, or a relay to it"]
    (out,) = await fleet.generate(request(max_tokens=3, n=1))
    assert out.worker_id == "a"
    # A ready worker's address taken over by a relay to another worker is found at its next check.
    provider.add("c")
    await fleet.refresh()
    assert fleet.workers["c"].state == WorkerState.READY
    provider.engines["c"].instance = provider.engines["a"].instance
    await fleet.refresh()
    assert fleet.workers["c"].state == WorkerState.DEAD and "instance of worker a" in fleet.workers["c"].error
    assert fleet.workers["a"].state == WorkerState.READY
    await fleet.close()


class Clock:
    """The roster's clock (inference/fleet/roster.py), moved by hand: the claim checks read it,
    asyncio's own clock runs on."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def held_by(run: str, worker_id: str):
    """A health check another run's claim refuses (WorkerHeldByAnotherRun)."""
    async def refused():
        raise WorkerHeldByAnotherRun(worker_id, "GET /health", run, 25)

    return refused


async def test_the_runs_claim_on_its_workers_is_renewed_while_the_listing_fails(monkeypatch):
    """The claim was renewed only by the health checks of a discovery round, which a failing
    listing (a frontend's 5xx, an etcd hiccup) skipped: it lapsed while the run still routed to
    the worker, and another run could take and refit it (review of issue 36, items 6 and 9).
    Renewals now go on apart from discovery."""
    clock = Clock()
    monkeypatch.setattr(roster, "time", clock)
    provider, logged = FakeProvider("a"), []
    fleet = Fleet(provider, discovery_interval_s=0.01, claim_trusted_s=10, log=logged.append)
    await fleet.start()
    control = provider.admin(fleet.workers["a"])
    health, checks = control.health, []

    async def counted():
        checks.append(clock.now)
        return await health()

    async def listing_fails():
        raise FleetrlError("the frontend answered 503")

    monkeypatch.setattr(control, "health", counted)
    provider.discover = listing_fails
    for _ in range(3):  # 18 s in all, each step within the trust of the renewal before it
        clock.now += 6
        seen = len(checks)
        async with asyncio.timeout(10):
            while len(checks) == seen:  # a renewal at the new time
                await asyncio.sleep(0.01)
    assert "fleetrl: discovery failed: the frontend answered 503" in logged
    assert fleet.workers["a"].state == WorkerState.READY
    (out,) = await fleet.generate(request(max_tokens=4))
    assert out.version_error is None and out.spans == [VersionSpan(0, 0)]
    await fleet.close()


async def test_a_worker_whose_claim_may_have_lapsed_serves_nothing_until_verified_again(monkeypatch):
    """With no renewal answered for the trusted share of the lease, another run may hold the
    worker and have refitted it (on Dynamo's own worker kind its tokens' versions come from the
    fence, so this run would credit that run's tokens to its own version): it leaves routing at
    once, what it served meanwhile is not trained, and it serves again only once renewed and
    verified: refused while the other run holds it (stale, never restarted: not this run's), and
    refitted if its weights changed (review of issue 36, items 6 and 9)."""
    clock = Clock()
    monkeypatch.setattr(roster, "time", clock)
    provider = FakeProvider("a", step_s=0.01)
    fleet = Fleet(provider, discovery_interval_s=3600, claim_trusted_s=10, max_restarts=1, log=lambda *_: None)
    await fleet.start()
    transport = FakeTransport(provider)
    await fleet.publish(1, transport, weights)
    restarted = restarts_with_base_weights(provider)
    in_flight = asyncio.create_task(fleet.generate(request(max_tokens=50)))
    await asyncio.sleep(0.05)
    clock.now += 11  # no renewal: the discovery rounds failed, say
    assert fleet.routable_workers() == [] and fleet.workers["a"].state == WorkerState.STALE
    assert "claim may have lapsed" in fleet.workers["a"].error
    (out,) = await in_flight
    assert "worker a's claim may have lapsed while it served the request" in out.version_error
    await fleet.refresh()  # renewed: still this run's, holding v1, so verified and not sent the weights again
    assert fleet.workers["a"].state == WorkerState.READY and transport.transfers == [(["a"], 1)]

    clock.now += 11
    assert fleet.routable_workers() == []
    control = provider.admin(fleet.workers["a"])
    health = control.health
    monkeypatch.setattr(control, "health", held_by("runB", "a"))  # taken by another run, which refits it
    provider.engines["a"].version, provider.engines["a"].checksum = None, "runB's weights"
    await fleet.refresh()
    await asyncio.sleep(0.01)
    assert fleet.routable_workers() == [] and fleet.workers["a"].state == WorkerState.STALE
    assert "held by another fleetrl run, runB" in fleet.workers["a"].error and restarted == []
    monkeypatch.setattr(control, "health", health)  # let go: refitted before it serves
    await fleet.refresh()
    assert fleet.workers["a"].state == WorkerState.READY and transport.transfers[-1] == (["a"], 1)
    assert provider.engines["a"].checksum == "sum-v1" and provider.engines["a"].abandoned == 1
    (out,) = await fleet.generate(request(max_tokens=4))
    assert out.version_error is None and out.spans == [VersionSpan(1, 0)]
    await fleet.close()


async def test_a_worker_another_run_holds_is_never_restarted(monkeypatch):
    """A launched worker another run now holds, missed by a listing: its health check, refused,
    made it stale, and then it was marked dead "gone from discovery" and restarted, killing the
    other run's worker; a publish's health check made it dead too (review of issue 36, item 9).
    It stays stale, out of this run's fleet, until that run lets it go."""
    provider = FakeProvider("a", "b")
    fleet = Fleet(provider, discovery_interval_s=3600, max_restarts=2, log=lambda *_: None)
    await fleet.start()
    restarted = restarts_with_base_weights(provider)
    monkeypatch.setattr(provider.admin(fleet.workers["b"]), "health", held_by("runB", "b"))
    listed = provider.discover

    async def without_b():
        return [w for w in await listed() if w.id != "b"]

    provider.discover = without_b
    await fleet.refresh()
    await fleet.refresh()
    await asyncio.sleep(0.01)
    assert fleet.workers["b"].state == WorkerState.STALE and restarted == []
    provider.discover = listed
    report = await fleet.publish(1, FakeTransport(provider), weights)
    await asyncio.sleep(0.01)
    assert report.ready == ["a"] and "held by another fleetrl run, runB" in report.failed["b"]
    assert fleet.workers["b"].state == WorkerState.STALE and restarted == []
    await fleet.close()
