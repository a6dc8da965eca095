"""fleetrl's Dynamo worker kind takes only admin calls signed with the run's admin token (issue
27, item 5) for this start of this worker (issue 36, item 5): the signature rides in the JSON
body, the only part of a call Dynamo's route handlers see, and every answer carries the
worker's proof of it (engine/dynamo_worker.py, admin_signature.py). A real HTTP round trip,
with a stand-in for Dynamo's system server."""

import json
import sys
import types

import httpx
import pytest

from fleetrl import admin_signature
from fleetrl.contract import ADMIN_TOKEN_ENV, DYNAMO_GUARDED_ROUTES, STALE_INSTANCE
from fleetrl.engine.dynamo_worker import INSTANCE, _require_signed_calls, signed_calls_only
from fleetrl.inference.dynamo.admin import DynamoAdminRoutes, DynamoWorkerControl
from fleetrl.inference.provider import ImpostorWorker, WorkerCallError

from .asgi_server import request_body, serving

TOKEN = "the-admin-token"


def system_server(calls: list, token: str = TOKEN, answer_ok_unguarded: bool = False, instance: str = INSTANCE,
                  rewrite=None):
    """Dynamo's system server in miniature: POST /engine/<route> hands the JSON body to the
    route's handler (wrapped as fleetrl's worker kind wraps it, once per route, for the worker
    `instance`) and answers its dict; `rewrite` changes that dict on its way (a proxy, say)."""
    routes = {}

    def handler(route):
        async def handle(self, body):
            calls.append((route, body))
            return {"status": "ok", "version": "v1@r1", "version_declared": True, "token_versions": True,
                    "alive": True, "results": [{"checksum": "c" * 64}]}
        return handle if answer_ok_unguarded else signed_calls_only(token, route, handle, instance)

    async def app(scope, receive, send):
        body = await request_body(receive)
        route = scope["path"].removeprefix("/engine/")
        handle = routes.setdefault(route, handler(route))
        result = await handle(None, json.loads(body or b"{}"))
        result = rewrite(result) if rewrite else result
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": json.dumps(result).encode()})
    return app


def client(url: str, token: str | None = TOKEN) -> DynamoWorkerControl:
    return DynamoWorkerControl(DynamoAdminRoutes("7", url, world_size=1, timeout_s=5, retries=1, run="r1",
                                                 admin_token=token))


async def test_a_signed_call_reaches_the_route_with_its_body_and_is_proven():
    calls = []
    with serving(system_server(calls)) as url:
        admin = client(url)
        try:
            assert await admin.version() == 1
            await admin.routes.call("set_weight_version", {"weight_version": "v2@r1"})
            assert await admin.health()
        finally:
            await admin.close()
    # The routes saw the body the client sent, without the signature (the first call asked
    # for the worker's instance).
    assert calls == [("liveness_probe", {}), ("get_weight_version", {}),
                     ("set_weight_version", {"weight_version": "v2@r1"}), ("liveness_probe", {})]


async def test_a_call_without_the_runs_token_reaches_nothing():
    calls = []
    with serving(system_server(calls)) as url:
        wrong = client(url, token="another-token")
        try:
            with pytest.raises(WorkerCallError, match=r"^worker 7: POST /engine/set_weight_version failed: the admin "
                                                      r"token was refused: set inference.admin_token"):
                await wrong.routes.call("set_weight_version", {"weight_version": "v9@evil"})
        finally:
            await wrong.close()
        unsigned = client(url, token=None)  # as anyone who reaches the system port
        try:
            with pytest.raises(WorkerCallError, match="fleetrl: this route needs the run's admin token"):
                await unsigned.routes.call("pause_generation", {"mode": "keep"})
            assert await unsigned.health()  # the liveness probe stays open
        finally:
            await unsigned.close()
    assert calls == [("liveness_probe", {}), ("liveness_probe", {})]  # the wrong token's client asked the instance


@pytest.mark.parametrize("tamper", ["replayed", "other body", "other route"])
async def test_a_signature_opens_one_call_of_one_body_once(tamper):
    calls = []
    handle = signed_calls_only(TOKEN, "set_weight_version", lambda self, body: _ok(calls, body))
    body, _ = admin_signature.signed_body(TOKEN, "/engine/set_weight_version", {"weight_version": "v2@r1"}, INSTANCE)
    assert (await handle(None, dict(body)))["status"] == "ok"
    if tamper == "other body":
        body = {**body, "weight_version": "v9@r1"}
    if tamper == "other route":
        handle = signed_calls_only(TOKEN, "pause_generation", lambda self, body: _ok(calls, body))
        body, _ = admin_signature.signed_body(TOKEN, "/engine/set_weight_version", {"mode": "keep"}, INSTANCE)
    answer = await handle(None, dict(body))
    assert answer == {"status": "error", "message": "fleetrl: this route needs the run's admin token (a signed call)"}
    assert len(calls) == 1


async def test_a_route_that_streams_its_answers_is_guarded_and_proven_too():
    """load_lora and unload_lora are async generators in Dynamo's handler: the wrapper streams."""
    calls = []

    async def load_lora(self, body):
        calls.append(body)
        yield {"status": "success", "lora_name": body["lora_name"]}

    handle = signed_calls_only(TOKEN, "load_lora", load_lora)
    request = {"lora_name": "policy-lora", "source": {"uri": "file:///elsewhere"}}
    refused = [answer async for answer in handle(None, dict(request))]
    assert refused == [{"status": "error", "message": "fleetrl: this route needs the run's admin token (a signed call)"}]
    body, nonce = admin_signature.signed_body(TOKEN, "/engine/load_lora", request, INSTANCE)
    [answer] = [answer async for answer in handle(None, dict(body))]
    proof = answer.pop(admin_signature.BODY_PROOF_FIELD)
    assert answer["status"] == "success" and proof == admin_signature.body_proof(TOKEN, nonce, INSTANCE, answer)
    assert calls == [request]


async def _ok(calls, body):
    calls.append(body)
    return {"status": "ok"}


async def test_a_process_on_the_system_port_that_cannot_prove_the_token_is_an_impostor():
    calls = []
    with serving(system_server(calls, answer_ok_unguarded=True)) as url:
        admin = client(url)
        try:
            for call in (admin.version, admin.health):
                with pytest.raises(ImpostorWorker, match="without proof that it holds the run's admin token"):
                    await call()
        finally:
            await admin.close()
    assert not any(TOKEN in json.dumps(body) for _, body in calls)  # the token itself never crossed the wire


def test_the_worker_kind_refuses_to_start_without_the_token(monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit, match=f"fleetrl: {ADMIN_TOKEN_ENV} is not set"):
        _require_signed_calls()


def test_every_route_that_changes_the_worker_is_guarded():
    assert {"pause_generation", "resume_generation", "update_weights_from_distributed", "set_weight_version",
            "init_weights_update_group", "sleep", "wake_up", "load_lora", "unload_lora"} <= set(DYNAMO_GUARDED_ROUTES)
    assert "liveness_probe" not in DYNAMO_GUARDED_ROUTES


# -- issue 36, item 5: a signature holds for one start of one worker; a proof for one answer -------

OLD, NEW = "a" * 32, "b" * 32  # two instances: one worker before and after a restart, or two workers


async def test_a_call_captured_before_a_restart_opens_nothing_after_it_and_the_run_signs_anew():
    calls = []
    worker = [system_server(calls, instance=OLD)]

    async def system_port(scope, receive, send):  # whichever start of the worker listens there
        await worker[0](scope, receive, send)

    captured, _ = admin_signature.signed_body(TOKEN, "/engine/pause_generation", {"mode": "keep"}, OLD)
    with serving(system_port) as url:
        admin = client(url)
        try:
            async with httpx.AsyncClient(base_url=url) as anyone:
                assert (await anyone.post("/engine/pause_generation", json=captured)).json()["status"] == "ok"
                assert await admin.version() == 1
                worker[0] = system_server(calls, instance=NEW)  # restarted at the same port, within 300 s
                answer = (await anyone.post("/engine/pause_generation", json=captured)).json()
                assert answer == {"status": "error", "message": STALE_INSTANCE}
            # The run's own client is refused as stale once, asks for the instance again, and signs anew.
            assert await admin.version() == 1
        finally:
            await admin.close()
    assert [route for route, _ in calls] == ["pause_generation", "liveness_probe", "get_weight_version",
                                            "liveness_probe", "get_weight_version"]


async def test_a_call_signed_for_one_worker_opens_nothing_at_another():
    """Every worker of a run takes the run's token: a call to one, captured, must not open another."""
    calls = []
    with serving(system_server(calls, instance=OLD)) as one, serving(system_server(calls, instance=NEW)) as other:
        body, _ = admin_signature.signed_body(TOKEN, "/engine/pause_generation", {"mode": "keep"}, OLD)
        assert httpx.post(one + "/engine/pause_generation", json=body).json()["status"] == "ok"
        assert httpx.post(other + "/engine/pause_generation", json=body).json()["status"] == "error"
    assert calls == [("pause_generation", {"mode": "keep"})]


async def test_a_relay_on_a_dead_workers_port_announces_the_live_workers_instance():
    """Dynamo's handlers see no address: a process on dead worker A's system port that passes
    fleetrl's calls on to live worker B gets them proven (a relay is B's URL under A's name).
    What A's client learns is B's instance, which the fleet has pinned to B and refuses for A
    (unit/test_fleet.py::test_a_worker_that_announces_another_live_workers_instance_is_kept_out_in_one_line)."""
    with serving(system_server([], instance=NEW)) as worker_b:
        a, b = client(worker_b), DynamoWorkerControl(DynamoAdminRoutes("8", worker_b, world_size=1, timeout_s=5,
                                                                       retries=1, run="r1", admin_token=TOKEN))
        try:
            assert a.instance is None  # not asked yet: nothing to pin
            assert await a.health() and await b.health()
            assert a.instance == b.instance == NEW
        finally:
            await a.close()
            await b.close()


@pytest.mark.parametrize("rewritten", ["version label", "checksum"])
async def test_an_answer_rewritten_on_its_way_proves_nothing(rewritten):
    """A proxy between the run and a real worker rewrites the label the worker reports, or its
    ranks' checksum into the one the sender expects: the proof covers the answer, so neither
    is believed."""
    def rewrite(answer):
        if rewritten == "version label":
            return {**answer, "version": "v7@r1"}
        return {**answer, "results": [{"checksum": "e" * 64}]}

    with serving(system_server([], rewrite=rewrite)) as url:
        admin = client(url)
        try:
            with pytest.raises(ImpostorWorker, match="without proof .* or the answer was changed on its way"):
                await (admin.version() if rewritten == "version label" else admin.verify_weights("e" * 64))
        finally:
            await admin.close()


def test_the_model_taints_route_is_not_served(monkeypatch):
    """Dynamo's POST /engine/update/model_taints took anyone's call on fleetrl's worker kind:
    the kind no longer registers it (the real route's refusal: tests/integration/test_providers.py)."""
    registered = []

    def register_model_taint_route(runtime, endpoint):  # Dynamo's, in miniature
        runtime.register_engine_route("update/model_taints", lambda body: {"status": "ok"})

    class Runtime:
        def register_engine_route(self, name, handler):
            registered.append(name)

    handlers = types.ModuleType("dynamo.vllm.handlers")
    handlers.BaseWorkerHandler = type("BaseWorkerHandler", (), {
        route: _ok for route in (*DYNAMO_GUARDED_ROUTES, "liveness_probe")})
    worker_factory = types.ModuleType("dynamo.vllm.worker_factory")
    worker_factory.register_model_taint_route = register_model_taint_route
    import dynamo.vllm

    monkeypatch.setitem(sys.modules, "dynamo.vllm.handlers", handlers)
    monkeypatch.setitem(sys.modules, "dynamo.vllm.worker_factory", worker_factory)
    monkeypatch.setattr(dynamo.vllm, "handlers", handlers, raising=False)
    monkeypatch.setattr(dynamo.vllm, "worker_factory", worker_factory, raising=False)
    monkeypatch.setenv(ADMIN_TOKEN_ENV, TOKEN)
    _require_signed_calls()
    worker_factory.register_model_taint_route(Runtime(), endpoint=None)
    assert registered == []
