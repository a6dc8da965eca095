"""Hermetic pieces of the Dynamo provider: sequence-level versions from the fence record,
RL discovery entries, the pause modes the upstream worker allows, and the check of a
prefill worker's version."""

import json
from dataclasses import replace

import httpx
import pytest

from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo.admin import DynamoAdminRoutes, DynamoWorkerControl
from fleetrl.inference.dynamo.attribution import FenceRecord, prefill_agrees, sequence_version
from fleetrl.inference.dynamo.data import DynamoDataClient
from fleetrl.inference.dynamo.discovery import list_rl_workers, parse_worker
from fleetrl.inference.dynamo.launcher import why_not_serving
from fleetrl.inference.dynamo.worker_kinds import DYNAMOS_OWN, FLEETRLS, kind_reporting
from fleetrl.inference.types import GenerateResponse, WorkerInfo, WorkerRole
from fleetrl.versions import VersionSpan

READY_V3 = FenceRecord(pauses=2, resumes=2, paused=False, version=3)


def test_no_pause_in_flight_gives_the_dispatch_version():
    assert sequence_version(READY_V3, READY_V3) == 3


def test_pause_without_resume_before_receipt_gives_the_dispatch_version():
    # Paused and even set to v4, but not resumed: the engine produced nothing since the pause.
    during = FenceRecord(pauses=3, resumes=2, paused=True, version=4)
    assert sequence_version(READY_V3, during) == 3


def test_a_resume_before_receipt_makes_the_version_unknown():
    after = FenceRecord(pauses=3, resumes=3, paused=False, version=4)
    assert sequence_version(READY_V3, after) is None


def test_rl_worker_entry_becomes_a_worker():
    entry = {"component": "prefill", "instance_id": 42, "system_url": "http://127.0.0.1:9/", "world_size": 2}
    worker = parse_worker(entry, "http://x/v1/rl/workers", "http://frontend")
    assert (worker.id, worker.admin_url, worker.role, worker.world_size) == ("42", "http://127.0.0.1:9", WorkerRole.PREFILL, 2)
    assert worker.data_url == "http://frontend"  # requests go through the frontend, which routes
    assert parse_worker({**entry, "component": "backend"}, "", "").role == WorkerRole.AGGREGATED
    with pytest.raises(FleetrlError, match="system URL"):
        parse_worker({"instance_id": 1}, "http://x/v1/rl/workers", "http://frontend")


async def test_backend_workers_beside_prefill_workers_are_decode_workers():
    entries = [{"component": c, "instance_id": i, "system_url": f"http://127.0.0.1:{9000 + i}"}
               for i, c in enumerate(["backend", "prefill"])]
    listing = httpx.MockTransport(lambda request: httpx.Response(200, json={"workers": entries}))
    async with httpx.AsyncClient(transport=listing) as http:
        assert [w.role for w in await list_rl_workers(http, "http://rl", "http://f", 10.0)] == [WorkerRole.DECODE, WorkerRole.PREFILL]
        listing.handler = lambda request: httpx.Response(200, json={"workers": entries[:1]})
        assert [w.role for w in await list_rl_workers(http, "http://rl", "http://f", 10.0)] == [WorkerRole.AGGREGATED]


async def test_an_instance_the_frontend_cannot_reach_is_left_out():
    """A SIGKILLed worker stays in etcd until its lease expires; meanwhile the frontend lists it
    with an error and no system URL (seen with Dynamo 1.6.1). Discovery must go on for the others."""
    entries = [{"component": "backend", "instance_id": 7, "transport": {"tcp": "127.0.0.1:1/7/fleetrl/backend/rl"},
                "routes": [], "error": "Unavailable: TCP connection to 127.0.0.1:1 failed"},
               {"component": "backend", "instance_id": 8, "system_url": "http://127.0.0.1:9008"}]
    listing = httpx.MockTransport(lambda request: httpx.Response(200, json={"workers": entries}))
    async with httpx.AsyncClient(transport=listing) as http:
        assert [w.id for w in await list_rl_workers(http, "http://rl", "http://f", 10.0)] == ["8"]


async def test_startup_waits_until_the_frontend_serves_every_decode_and_prefill_worker():
    """RL discovery lists workers before the frontend routes to them (404, no body)."""
    workers = [WorkerInfo("10", "", "", WorkerRole.DECODE), WorkerInfo("21", "", "", WorkerRole.PREFILL),
               WorkerInfo("22", "", "", WorkerRole.PREFILL)]
    pinned, known = [], {"10", "21"}

    def frontend(request):
        pins = (request.headers["x-worker-instance-id"], request.headers["x-prefill-instance-id"])
        pinned.append(pins)
        if not set(pins) <= known:
            return httpx.Response(404)
        served = {"decode_worker_id": int(pins[0]), "prefill_worker_id": int(pins[1])}  # as Dynamo: numbers
        return httpx.Response(200, json={"choices": [{"finish_reason": "length"}],
                                         "nvext": {"completion_token_ids": [5], "worker_id": served}})
    async with DynamoDataClient("http://f", "policy", timeout_s=1, run="r1") as data:
        await data._http.aclose()  # replaced by the fake frontend, which the context closes
        data._http = httpx.AsyncClient(base_url="http://f", transport=httpx.MockTransport(frontend))
        assert "HTTP 404" in await why_not_serving(data, workers)
        known.add("22")
        pinned.clear()
        assert await why_not_serving(data, workers) is None
        assert pinned == [("10", "21"), ("10", "22")]  # every prefill worker, every decode worker
        assert await why_not_serving(data, workers[1:]) == "no decode worker listed"


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_keep_and_abort_pauses_need_per_token_versions(mode, monkeypatch):
    admin = DynamoWorkerControl(DynamoAdminRoutes("7", "http://127.0.0.1:9", world_size=1, timeout_s=1, retries=0,
                                                  run="r1"))

    async def dynamo_own_worker():
        return DYNAMOS_OWN
    monkeypatch.setattr(admin, "worker_kind", dynamo_own_worker)
    with pytest.raises(FleetrlError, match="worker 7: pause .* reports no per-token versions"):
        await admin.pause(mode)
    assert admin.routes.fence == FenceRecord()  # nothing sent, nothing counted
    await admin.close()


def test_each_worker_kind_gives_a_completions_versions_its_own_way():
    """Dynamo's own worker: the fence record's one version, none while paused or unversioned, and
    none for a completion that straddled a publish; fleetrl's: the engine's spans, and its abort
    told from a stop (issue 38, item 3: two strategies instead of a flag)."""
    assert kind_reporting(False) is DYNAMOS_OWN and kind_reporting(True) is FLEETRLS
    completion = GenerateResponse("r", [5, 6], [-1.0, -1.0], "length", "7", [])
    assert DYNAMOS_OWN.dispatchable(READY_V3) and FLEETRLS.dispatchable(FenceRecord())
    assert not DYNAMOS_OWN.dispatchable(FenceRecord()) and not DYNAMOS_OWN.dispatchable(replace(READY_V3, paused=True))
    (attributed,) = DYNAMOS_OWN.attributed([completion], READY_V3, READY_V3)
    assert attributed.spans == [VersionSpan(3, 0)]
    straddled = replace(READY_V3, pauses=READY_V3.pauses + 1, resumes=READY_V3.resumes + 1)
    assert DYNAMOS_OWN.attributed([completion], READY_V3, straddled) is None
    assert FLEETRLS.attributed([completion], READY_V3, straddled) == [completion]
    engine = {"weight_versions": ["v3@r1"], "engine_finish_reason": "abort"}
    assert (FLEETRLS.finish_reason("stop", engine), DYNAMOS_OWN.finish_reason("stop", engine)) == ("abort", "stop")
    assert (FLEETRLS.weight_versions(engine), DYNAMOS_OWN.weight_versions(engine)) == (["v3@r1"], None)
    with pytest.raises(FleetrlError, match="returned no per-token versions.*is it fleetrl's worker kind"):
        FLEETRLS.check_engine_data({}, "7", "r", "r1")
    DYNAMOS_OWN.check_engine_data({}, "7", "r", "r1")


def test_a_prefill_worker_must_provably_hold_the_completions_version():
    at_receipt = {"p": READY_V3}  # the prefill worker's fence record when the completion arrived

    def agrees(completion, at_dispatch):
        return prefill_agrees(completion, at_dispatch, at_receipt)

    completion = GenerateResponse("r", [5, 6], [-1.0, -1.0], "length", "d", [VersionSpan(3, 0)], prefill_worker_id="p")
    assert agrees(completion, {"p": READY_V3})
    assert agrees(replace(completion, prefill_worker_id=None), {})  # aggregated: nothing to check
    assert not agrees(replace(completion, spans=[VersionSpan(4, 0)]), {"p": READY_V3})  # other version
    assert not agrees(replace(completion, prefill_worker_id="x"), {"p": READY_V3})  # unknown to fleetrl
    assert not agrees(completion, {"p": replace(READY_V3, paused=True)})  # paused at dispatch
    at_receipt["p"] = FenceRecord(pauses=3, resumes=3, paused=False, version=4)
    assert not agrees(completion, {"p": READY_V3})  # a publish went through it meanwhile


async def test_is_paused_asks_the_route_that_runs_only_on_a_paused_worker():
    """Dynamo has no is_paused route: its weight-update route refuses an unpaused worker."""
    paused = False

    def worker(request):
        body = json.loads(request.content)
        assert request.url.path == "/engine/update_weights_from_distributed"
        assert body == {"engine_rpc": "fleetrl_broadcast_group", "reset_prefix_cache": False}  # reads only
        if paused:
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json={"status": "error", "message": "Worker must be paused via "
                                         "pause_generation() before updating weights."})
    admin = DynamoWorkerControl(DynamoAdminRoutes("7", "http://127.0.0.1:9", world_size=1, timeout_s=1, retries=0,
                                                  run="r1"))
    await admin.routes.http.close()
    admin.routes.http._http = httpx.AsyncClient(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(worker))
    assert await admin.is_paused() is False
    paused = True
    assert await admin.is_paused() is True
    await admin.close()


def test_the_dynamo_worker_refuses_versions_its_changes_were_not_written_for():
    """Its changes to Dynamo's and vLLM's internals are checked against the versions they were
    written for, at start-up, with one line (not deep in a request, as once a renamed name)."""
    from fleetrl.engine.dynamo_worker import PATCHED_AGAINST, check_patched_versions

    check_patched_versions(PATCHED_AGAINST.get)
    check_patched_versions({**PATCHED_AGAINST, "vllm": PATCHED_AGAINST["vllm"] + "+cpu"}.get)  # a local build tag
    with pytest.raises(SystemExit, match=r"^fleetrl: error: fleetrl's Dynamo worker changes internals of vllm 0.32.0, "
                                         r"but vllm 0.33.1 is installed \(install vllm==0.32.0\)$"):
        check_patched_versions({**PATCHED_AGAINST, "vllm": "0.33.1"}.get)
    assert set(PATCHED_AGAINST) == {"ai-dynamo", "vllm"}
