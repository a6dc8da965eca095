"""Two runs on one Dynamo deployment (issue 36, item 6): a Dynamo worker is held by one run at a
time, as a native server is. The claim rides in the JSON body of every RL call (the only part
Dynamo's route handlers see) and is kept by fleetrl's worker entry, in both worker kinds
(engine/dynamo_worker.held_for_one_run, engine/worker_claim.py). A real HTTP round trip, with a
stand-in for Dynamo's system server wrapped as the worker's entry wraps its routes."""

import json
import time

import httpx
import pytest

from fleetrl.config import DynamoConfig, InferenceConfig
from fleetrl.contract import DYNAMO_CLAIM_FIELD
from fleetrl.engine.dynamo_worker import held_for_one_run, signed_calls_only
from fleetrl.engine.worker_claim import WorkerClaim
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.provider import WorkerHeldByAnotherRun
from fleetrl.inference.types import WorkerInfo

from .asgi_server import request_body, serving

TOKEN = "the-admin-token"


def system_server(calls: list, kind: str, clock=time.monotonic):
    """Dynamo's system server in miniature: POST /engine/<route> hands the JSON body to the
    route's handler, wrapped as `python -m fleetrl.engine.dynamo_worker` wraps it (one claim for
    the whole worker, on the worker's `clock`; fleetrl's kind also takes only signed calls, its
    outermost layer)."""
    claim = WorkerClaim(clock)

    def handler(route: str):
        async def handle(self, body):
            calls.append((route, body))
            return {"status": "ok", "version": "default", "version_declared": False, "alive": True}
        return handle

    async def app(scope, receive, send):
        body = await request_body(receive)
        route = scope["path"].removeprefix("/engine/")
        handle = held_for_one_run(claim, handler(route))
        if kind == "fleetrl":
            handle = signed_calls_only(TOKEN, route, handle)
        result = await handle(None, json.loads(body or b"{}"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": json.dumps(result).encode()})
    return app


def provider(kind: str, tmp_path, run: str | None, **inference) -> DynamoProvider:
    """Run `run`'s provider attached to the stand-in (only its admin clients are used here);
    `run` None: one that only looks (`fleetrl status`)."""
    token = {"admin_token": TOKEN} if kind == "fleetrl" else {}
    config = InferenceConfig(provider="dynamo", dynamo=DynamoConfig(worker=kind), **token, **inference)
    return DynamoProvider(config, tmp_path, tmp_path, run, log=lambda line: None)


@pytest.mark.parametrize("kind", ["dynamo", "fleetrl"])
async def test_a_dynamo_worker_another_run_holds_refuses_it_naming_the_holder(tmp_path, kind):
    """The second run is refused at its first call (its fleet's health check) with one line
    naming the worker and the run holding it, its calls reach none of the worker's routes, and
    once the first run's provider closes (its fleet stopped) the worker is the second's."""
    calls = []
    with serving(system_server(calls, kind)) as url:
        worker = WorkerInfo(id="7", data_url="http://frontend", admin_url=url)
        a, b = provider(kind, tmp_path, "runA"), provider(kind, tmp_path, "runB")
        looker = provider(kind, tmp_path, None)  # `fleetrl status`
        try:
            assert await a.admin(worker).health() and await a.admin(worker).version() is None
            seen = len(calls)
            with pytest.raises(WorkerHeldByAnotherRun, match=rf"^worker 7: liveness_probe at {url} failed: held by "
                                                             r"another fleetrl run, runA \(its claim lapses 30 s"):
                await b.admin(worker).health()
            for call in (b.admin(worker).version, b.admin(worker).is_paused):
                with pytest.raises(WorkerHeldByAnotherRun, match="held by another fleetrl run, runA"):
                    await call()
            # Refused before the route ran (what reached one only looked: the probe that asks the
            # worker which instance it is, on fleetrl's kind).
            assert all(route == "liveness_probe" for route, _ in calls[seen:]), calls[seen:]
            assert await looker.admin(worker).health()  # looks, holds nothing, refused nothing
            await a.close()  # lets the worker go
            assert await b.admin(worker).health()
            again = provider(kind, tmp_path, "runA")
            with pytest.raises(WorkerHeldByAnotherRun, match="held by another fleetrl run, runB"):
                await again.admin(worker).health()
            await again.close()
        finally:
            await b.close()
            await looker.close()
    # Dynamo's handlers never see the claim: it is the worker entry's.
    assert not any(DYNAMO_CLAIM_FIELD in body for _, body in calls), calls


async def test_a_killed_runs_claim_on_a_dynamo_worker_lapses_after_its_lease(tmp_path):
    """The lease runs on the worker's clock, moved here by hand: on a busy machine a real
    0.3 s lease lapsed before run B's first call (CI, stop 54)."""
    calls, now = [], [0.0]
    with serving(system_server(calls, "dynamo", clock=lambda: now[0])) as url:
        worker = WorkerInfo(id="7", data_url="http://frontend", admin_url=url)
        a, b = provider("dynamo", tmp_path, "runA"), provider("dynamo", tmp_path, "runB")  # leases of 30 s
        try:
            assert await a.admin(worker).health()  # then run A is killed: it never lets go
            with pytest.raises(WorkerHeldByAnotherRun):
                await b.admin(worker).health()
            now[0] += 29.9
            with pytest.raises(WorkerHeldByAnotherRun):
                await b.admin(worker).health()
            now[0] += 0.2
            assert await b.admin(worker).health()
        finally:
            await b.close()


async def test_on_fleetrls_kind_only_a_signed_call_claims_the_worker(tmp_path):
    """Anyone who reaches the system port may call its open liveness probe, but naming a run
    there holds nothing: the claim of a call without the run's signature is dropped."""
    calls = []
    with serving(system_server(calls, "fleetrl")) as url:
        async with httpx.AsyncClient(base_url=url) as anyone:
            answer = (await anyone.post("/engine/liveness_probe",
                                        json={DYNAMO_CLAIM_FIELD: {"run": "squatter", "lease_s": 600}})).json()
        assert answer["alive"] is True
        run = provider("fleetrl", tmp_path, "runA")
        try:
            assert await run.admin(WorkerInfo(id="7", data_url="http://frontend", admin_url=url)).health()
        finally:
            await run.close()


async def test_a_route_that_streams_its_answers_is_held_for_one_run_too():
    """load_lora and unload_lora are async generators in Dynamo's handler: the wrapper streams,
    and the claim is held until the stream ends."""
    claim, calls = WorkerClaim(), []

    async def load_lora(self, body):
        calls.append(body)
        assert claim.begin("runB", 30) == "runA"  # held while the route runs
        yield {"status": "success", "lora_name": body["lora_name"]}

    handle = held_for_one_run(claim, load_lora)
    request = {"lora_name": "policy-lora"}
    [answer] = [a async for a in handle(None, {**request, DYNAMO_CLAIM_FIELD: {"run": "runA", "lease_s": 30}})]
    assert answer["status"] == "success" and calls == [request]
    [refused] = [a async for a in handle(None, {**request, DYNAMO_CLAIM_FIELD: {"run": "runB", "lease_s": 30}})]
    assert refused["status"] == "error" and refused["held_by"] == "runA" and len(calls) == 1
