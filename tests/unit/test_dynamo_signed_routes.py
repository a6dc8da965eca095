"""fleetrl's Dynamo worker kind takes only admin calls signed with the run's admin token (issue
27, item 5): the signature rides in the JSON body, the only part of a call Dynamo's route
handlers see, and every answer carries the worker's proof (engine/dynamo_worker.py,
admin_signature.py). A real HTTP round trip, with a stand-in for Dynamo's system server."""

import json

import pytest

from fleetrl import admin_signature
from fleetrl.contract import ADMIN_TOKEN_ENV, DYNAMO_GUARDED_ROUTES
from fleetrl.engine.dynamo_worker import _require_signed_calls, signed_calls_only
from fleetrl.inference.dynamo.admin import DynamoAdminRoutes, DynamoWorkerControl
from fleetrl.inference.provider import ImpostorWorker, WorkerCallError

from .asgi_server import serving

TOKEN = "the-admin-token"


def system_server(calls: list, token: str = TOKEN, answer_ok_unguarded: bool = False):
    """Dynamo's system server in miniature: POST /engine/<route> hands the JSON body to the
    route's handler (wrapped as fleetrl's worker kind wraps it) and answers its dict."""
    async def handler(route):
        async def handle(self, body):
            calls.append((route, body))
            return {"status": "ok", "version": "v1@r1", "version_declared": True, "token_versions": True,
                    "alive": True}
        return handle

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        route = scope["path"].removeprefix("/engine/")
        handle = await handler(route)
        if not answer_ok_unguarded:
            handle = signed_calls_only(token, route, handle)
        result = await handle(None, json.loads(body or b"{}"))
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
    # The routes saw the body the client sent, without the signature.
    assert calls == [("get_weight_version", {}), ("set_weight_version", {"weight_version": "v2@r1"}),
                     ("liveness_probe", {})]


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
    assert calls == [("liveness_probe", {})]


@pytest.mark.parametrize("tamper", ["replayed", "other body", "other route"])
async def test_a_signature_opens_one_call_of_one_body_once(tamper):
    calls = []
    handle = signed_calls_only(TOKEN, "set_weight_version", lambda self, body: _ok(calls, body))
    body, _ = admin_signature.signed_body(TOKEN, "/engine/set_weight_version", {"weight_version": "v2@r1"})
    assert (await handle(None, dict(body)))["status"] == "ok"
    if tamper == "other body":
        body = {**body, "weight_version": "v9@r1"}
    if tamper == "other route":
        handle = signed_calls_only(TOKEN, "pause_generation", lambda self, body: _ok(calls, body))
        body, _ = admin_signature.signed_body(TOKEN, "/engine/set_weight_version", {"mode": "keep"})
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
    body, nonce = admin_signature.signed_body(TOKEN, "/engine/load_lora", request)
    [answer] = [answer async for answer in handle(None, dict(body))]
    assert answer["status"] == "success" and answer[admin_signature.BODY_PROOF_FIELD] == \
        admin_signature.proof(TOKEN, nonce, "")
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
