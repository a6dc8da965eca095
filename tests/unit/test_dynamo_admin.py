"""Hermetic checks of how fleetrl guards a Dynamo deployment's admin plane, which has no
authentication of its own: launched workers' system ports stay on loopback unless the config
says the network protects them, a token set for Dynamo is refused rather than ignored, and a
worker proves its weights by the checksums its ranks computed, not by a bare "ok"."""

import json

import httpx
import pytest

from fleetrl.app.providers import Tokens, build_provider
from fleetrl.config import Config, ConfigError, DynamoConfig, InferenceConfig, RunConfig
from fleetrl.contract import ADMIN_TOKEN_ENV, WEIGHT_STATE_METHOD
from fleetrl.engine.dynamo_worker import _answering_checksums
from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo import launcher
from fleetrl.inference.dynamo.admin import DynamoAdminRoutes, DynamoWorkerControl
from fleetrl.inference.dynamo.worker_kinds import FLEETRLS
from fleetrl.rundir import RunDir


class Started(Exception):
    """What the fake start_process raises: the launch got past its checks."""


@pytest.fixture
def start_process(monkeypatch):
    def started(name, argv, log_path, env=None, **_):
        raise Started(env["DYN_SYSTEM_HOST"])
    monkeypatch.setattr(launcher, "start_process", started)


async def launch(tmp_path, **inference):
    await launcher.launch_dynamo(tmp_path, InferenceConfig(provider="dynamo", **inference), 1, tmp_path)


@pytest.mark.parametrize("inference", [
    dict(host="0.0.0.0"),
    dict(host="10.0.3.17"),
    dict(host="worker-0.cluster.local"),  # a name may resolve to any interface
    dict(dynamo=DynamoConfig(env={"DYN_SYSTEM_HOST": "0.0.0.0"})),  # overridden by inference.dynamo.env
])
async def test_workers_whose_system_port_would_leave_loopback_are_not_launched(tmp_path, start_process, inference):
    with pytest.raises(FleetrlError, match="take no token, on .*: set inference.host to a loopback address, or set "
                                           "inference.dynamo.allow_unauthenticated_admin = true"):
        await launch(tmp_path, **inference)  # raises before any process starts (start_process would say Started)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.0.0.2"])
async def test_loopback_system_ports_are_launched(tmp_path, start_process, host):
    with pytest.raises(Started, match=host):
        await launch(tmp_path, host=host)


async def test_allow_unauthenticated_admin_launches_on_any_host(tmp_path, start_process):
    with pytest.raises(Started, match="0.0.0.0"):
        await launch(tmp_path, host="0.0.0.0", dynamo=DynamoConfig(allow_unauthenticated_admin=True))


@pytest.mark.parametrize("field, kind", [("admin_token", "dynamo"), ("data_token", "dynamo"),
                                         ("data_token", "fleetrl")])
def test_a_token_set_for_dynamo_is_refused_naming_the_field(tmp_path, field, kind):
    """Dynamo's frontend takes no token, nor do the admin routes of Dynamo's own worker kind."""
    config = Config(inference=InferenceConfig(provider="dynamo", dynamo=DynamoConfig(worker=kind), **{field: "secret"}),
                    run=RunConfig(dir=tmp_path))
    with pytest.raises(ConfigError, match=f"inference.{field} set with inference.provider = 'dynamo'"):
        build_provider(config, RunDir(tmp_path), None, Tokens(None, None))


def test_fleetrls_worker_kind_takes_the_admin_token_and_gives_it_to_its_workers_by_environment(tmp_path):
    config = Config(inference=InferenceConfig(provider="dynamo", dynamo=DynamoConfig(worker="fleetrl")),
                    run=RunConfig(dir=tmp_path))
    provider = build_provider(config, RunDir(tmp_path), None, Tokens("the-admin-token", None))
    assert provider.admin_token == "the-admin-token"
    assert provider.attach_settings()["admin_token"] == "the-admin-token"  # for fleetrl status RUN_DIR (tokens.json)
    env = launcher.worker_env(provider.config, tmp_path)
    assert env[ADMIN_TOKEN_ENV] == "the-admin-token"
    assert not any("the-admin-token" in arg for arg in launcher.worker_argv(tmp_path, provider.config, tmp_path, False))
    own = build_provider(Config(inference=InferenceConfig(provider="dynamo"), run=RunConfig(dir=tmp_path)),
                         RunDir(tmp_path), None, Tokens("the-admin-token", None))
    assert own.admin_token is None and ADMIN_TOKEN_ENV not in launcher.worker_env(own.config, tmp_path)


def admin_answering(answer: dict) -> DynamoWorkerControl:
    """A Dynamo control client whose worker answers fleetrl's checksum call with `answer`."""
    def worker(request):
        body = json.loads(request.content)
        assert request.url.path == "/engine/update_weights_from_distributed"
        assert body == {"engine_rpc": WEIGHT_STATE_METHOD, "reset_prefix_cache": False, "allow_unpaused": True}
        return httpx.Response(200, json=answer)
    admin = DynamoWorkerControl(DynamoAdminRoutes("7", "http://127.0.0.1:9", world_size=2, timeout_s=1, retries=0,
                                                  run="r1"))
    admin.routes.http._http = httpx.AsyncClient(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(worker))
    return admin


async def test_a_bare_ok_does_not_verify_a_workers_weights():
    admin = admin_answering({"status": "ok", "version": "unknown"})  # what Dynamo's own route answers
    with pytest.raises(FleetrlError, match="worker 7: weight check failed: the worker answered without its ranks' "
                                           "checksums"):
        await admin.verify_weights("abc")
    await admin.close()


def rank(checksum):
    return {"checksum": checksum, "received_at": 1.0 if checksum else None, "updating": False}


@pytest.mark.parametrize("checksums, ok", [(["abc", "abc"], True), (["abc", "other"], False), ([None, None], False),
                                           ([], False)])
async def test_every_rank_must_report_the_senders_checksum(checksums, ok):
    admin = admin_answering({"status": "ok", "results": [rank(c) for c in checksums]})
    if ok:
        await admin.verify_weights("abc")
    else:
        with pytest.raises(FleetrlError, match="weight checksum .* != sender's abc"):
            await admin.verify_weights("abc")
    await admin.close()


async def test_a_rank_answer_that_is_no_weight_state_is_an_error():
    admin = admin_answering({"status": "ok", "results": ["abc"]})  # a worker of an older fleetrl
    with pytest.raises(FleetrlError, match=r"worker 7: a rank's answer to the weight check \(a worker of another fleetrl "
                                           r"version\?\): not an object but str"):
        await admin.verify_weights("abc")
    await admin.close()


class FakeEngineClient:
    def __init__(self, results=None, error=None):
        self.results, self.error = results, error

    async def collective_rpc(self, method):
        assert method == WEIGHT_STATE_METHOD
        if self.error:
            raise self.error
        return self.results


class FakeHandler:
    def __init__(self, engine_client):
        self.engine_client = engine_client


async def test_the_worker_entry_answers_the_checksum_method_with_each_ranks_result():
    async def dynamos_route(self, body):
        return {"status": "ok", "version": "unknown", "by": "dynamo"}

    route = _answering_checksums(dynamos_route)
    handler = FakeHandler(FakeEngineClient(results=["abc", "def"]))
    body = {"engine_rpc": WEIGHT_STATE_METHOD, "allow_unpaused": True, "reset_prefix_cache": False}
    assert await route(handler, body) == {"status": "ok", "results": ["abc", "def"]}
    # Every other call is Dynamo's.
    assert (await route(handler, {"engine_rpc": "update_weights"}))["by"] == "dynamo"
    failing = FakeHandler(FakeEngineClient(error=RuntimeError("engine gone")))
    assert await route(failing, body) == {"status": "error",
                                          "message": f"{WEIGHT_STATE_METHOD}: RuntimeError: engine gone"}


async def test_an_instance_a_launched_deployment_did_not_launch_is_refused_before_the_fleet_sees_it(tmp_path,
                                                                                                   monkeypatch):
    """Another deployment's worker registered in this run's namespace: it is never paused, sent
    weights or routed to (issue 27, item 5); the refusal is logged once, naming it."""
    from fleetrl.inference.dynamo import provider as dynamo_provider
    from fleetrl.inference.types import WorkerInfo

    logged = []
    provider = dynamo_provider.DynamoProvider(InferenceConfig(provider="dynamo"), tmp_path, tmp_path, "r1",
                                              log=logged.append)

    class Deployment:
        def live_worker_at(self, admin_url):
            return object() if admin_url == "http://127.0.0.1:9001" else None

        def stop(self):
            pass

    async def listed(*args):
        return [WorkerInfo(id=i, data_url="http://f", admin_url=f"http://127.0.0.1:{port}")
                for i, port in (("1", 9001), ("2", 9002))]

    provider.deployment, provider._rl_url = Deployment(), "http://rl"
    monkeypatch.setattr(dynamo_provider, "list_rl_workers", listed)
    for _ in range(2):
        assert [w.id for w in await provider.discover()] == ["1"]
    assert logged == [f"fleetrl: Dynamo worker 2 at http://127.0.0.1:9002 refused: this run did not launch it "
                      f"(another deployment in namespace {provider.config.dynamo.namespace}?)"]
    await provider.close()


async def test_admin_clients_no_worker_needs_are_closed(tmp_path, monkeypatch):
    """A worker that comes back at another system URL gets a new client, and a restarted Dynamo
    worker is a new instance (a new id): the clients left behind are closed at the next discovery
    rounds, not kept open for the whole run (issue 27, item 12)."""
    from fleetrl.inference.dynamo import provider as dynamo_provider
    from fleetrl.inference.types import WorkerInfo

    provider = dynamo_provider.DynamoProvider(InferenceConfig(provider="dynamo"), tmp_path, tmp_path, "r1",
                                              log=lambda line: None)
    provider._rl_url = "http://rl"
    listed = []

    async def listing(*args):
        return list(listed)

    monkeypatch.setattr(dynamo_provider, "list_rl_workers", listing)
    worker = lambda i, port: WorkerInfo(id=i, data_url="http://f", admin_url=f"http://127.0.0.1:{port}")  # noqa: E731
    first = provider.admin(worker("7", 9001))
    second = provider.admin(worker("7", 9002))  # the same instance, at a new URL
    assert provider.weight_sync(worker("7", 9002)).routes is second.routes  # one fence record
    gone = provider.admin(worker("8", 9003))  # an instance that will leave discovery
    listed[:] = [worker("7", 9002)]
    closed = lambda client: client.routes.http._http.is_closed  # noqa: E731
    await provider.discover()
    assert closed(first) and not closed(second)
    assert not closed(gone)  # one round without it: a publish may still call it
    await provider.discover()
    assert closed(gone) and not closed(second)
    await provider.close()
    assert closed(second)


async def test_a_request_through_the_adapter_refused_by_a_pause_is_sent_again_once_the_worker_resumes(tmp_path,
                                                                                                      monkeypatch):
    """Dynamo's worker refuses a request through a LoRA adapter that arrives while it is paused
    (vLLM would hold it): one sent just before a publish paused the worker is sent again, whole,
    after the resume, and does not count as a failure. Without a pause since dispatch, or without
    an adapter, a failure is the caller's."""
    import asyncio

    from fleetrl.errors import FleetrlError
    from fleetrl.inference.dynamo import provider as dynamo_provider
    from fleetrl.inference.types import GenerateRequest, GenerateResponse, SamplingParams, WorkerInfo
    from fleetrl.lora import AdapterSpec
    from fleetrl.versions import VersionSpan

    spec = AdapterSpec(rank=8, alpha=16.0, target_modules=("q_proj",))
    worker = WorkerInfo(id="7", data_url="http://f", admin_url="http://127.0.0.1:9001")
    request = GenerateRequest([1, 2, 3], SamplingParams(max_tokens=2))
    sent, logged = [], []

    class NoData:  # the data client: gather_samples stands in for what it sends
        async def close(self):
            pass

    def provider_with(adapter):
        provider = dynamo_provider.DynamoProvider(InferenceConfig(provider="dynamo"), tmp_path, tmp_path, "r1",
                                                  log=logged.append, adapter=adapter)
        provider._data = NoData()
        admin = provider.admin(worker)

        async def fleetrls_kind():
            return FLEETRLS
        admin.worker_kind = fleetrls_kind
        return provider, admin.routes

    async def refused_while_a_publish_pauses(data, worker_id, prefill_id, request, suffix, kind):
        sent.append(routes.fence.paused)
        if len(sent) == 1:  # the publish pauses the worker as the request arrives, and resumes it later
            routes.fence = routes.fence.pausing()
            asyncio.get_running_loop().call_later(0.2, lambda: setattr(routes, "fence", routes.fence.resumed()))
            raise FleetrlError("worker 7: generate failed: HTTP 500 from http://f/v1/completions")
        return [GenerateResponse(request.request_id, [5, 6], [-0.1, -0.2], "length", worker_id,
                                 [VersionSpan(version=1, start=0)])]

    monkeypatch.setattr(dynamo_provider, "gather_samples", refused_while_a_publish_pauses)
    provider, routes = provider_with(spec)
    assert [r.token_ids for r in await provider.generate(worker, request)] == [[5, 6]]
    assert sent == [False, False]  # sent again only once resumed
    assert len(logged) == 1 and "reached it paused for a publish" in logged[0]
    await provider.close()

    sent.clear()
    provider, routes = provider_with(None)  # no adapter: Dynamo holds such a request; a failure is real
    with pytest.raises(FleetrlError, match="HTTP 500"):
        await provider.generate(worker, request)
    await provider.close()


async def test_a_lora_runs_worker_is_left_out_of_discovery_until_it_serves_the_adapter(tmp_path, monkeypatch):
    """A launched worker of a LoRA run joins the fleet only once /engine/load_lora named its own
    adapter folder and a request through the adapter, pinned to it, was served; until then each
    discovery round leaves it out, and says so once."""
    from types import SimpleNamespace

    from fleetrl.errors import FleetrlError
    from fleetrl.inference.dynamo import provider as dynamo_provider
    from fleetrl.inference.types import WorkerInfo
    from fleetrl.lora import ADAPTER_NAME, AdapterSpec

    logged, loads, smokes = [], [], []
    provider = dynamo_provider.DynamoProvider(InferenceConfig(provider="dynamo"), tmp_path, tmp_path, "r1",
                                              log=logged.append,
                                              adapter=AdapterSpec(rank=8, alpha=16.0, target_modules=("q_proj",)))

    class Deployment:
        def live_worker_at(self, admin_url):
            return SimpleNamespace(name="dynamo-worker-3")

        def stop(self):
            pass

    class Data:
        async def complete(self, worker_id, prefill_id, request, suffix, sample, kind):
            smokes.append(worker_id)
            if len(smokes) == 1:
                raise FleetrlError("HTTP 404: model policy-lora not found")

        async def close(self):
            pass

    async def listed(*args):
        return [WorkerInfo(id="7", data_url="http://f", admin_url="http://127.0.0.1:9001")]

    async def load_adapter(self, name, folder):
        loads.append((name, folder))

    provider.deployment, provider._rl_url, provider._data = Deployment(), "http://rl", Data()
    monkeypatch.setattr(dynamo_provider, "list_rl_workers", listed)
    monkeypatch.setattr(dynamo_provider.DynamoWorkerControl, "load_adapter", load_adapter)
    assert await provider.discover() == [] and await provider.discover() != []
    assert [w.id for w in await provider.discover()] == ["7"] and len(smokes) == 2  # asked until it served once
    assert loads == [(ADAPTER_NAME, tmp_path / "logs" / "dynamo-worker-3-adapter")] * 2
    assert len(logged) == 1 and "does not serve the LoRA adapter yet (HTTP 404" in logged[0]
    await provider.close()


async def test_a_killed_worker_is_replaced_even_while_its_process_is_still_exiting(tmp_path, monkeypatch):
    """The fleet marks a worker dead as soon as a request through it fails: its process may not
    have exited yet, nor listen any more. The process discovery saw serving the instance is the
    one replaced (a lookup by port then would find none, and the run would wait for nothing);
    the restart returns once the replacement is listed, with the id of the new instance."""
    from types import SimpleNamespace

    from fleetrl.inference.dynamo import provider as dynamo_provider
    from fleetrl.inference.types import WorkerInfo

    logged, replaced = [], []
    serving = SimpleNamespace(name="dynamo-worker-0", listening=True)
    replacement = SimpleNamespace(name="dynamo-worker-1", alive=lambda: True)
    instances = {"7": "http://127.0.0.1:9001"}

    class Deployment:
        workers = [serving]

        def live_worker_at(self, admin_url):
            if admin_url.endswith(":9002"):
                return replacement
            return serving if serving.listening else None  # exiting: not listening, not exited

        def replace_worker(self, process):
            replaced.append(process.name)
            instances["9"] = "http://127.0.0.1:9002"  # registers as a new instance
            return replacement

        def stop(self):
            pass

    async def listed(*args):
        return [WorkerInfo(id=i, data_url="http://f", admin_url=url) for i, url in instances.items()]

    provider = dynamo_provider.DynamoProvider(InferenceConfig(provider="dynamo"), tmp_path, tmp_path, "r1",
                                              log=logged.append)
    provider.deployment, provider._rl_url = Deployment(), "http://rl"
    monkeypatch.setattr(dynamo_provider, "list_rl_workers", listed)
    [worker] = await provider.discover()
    serving.listening = False  # SIGKILLed, still exiting
    assert await provider.restart(worker) == "9" and replaced == ["dynamo-worker-0"]
    assert logged[0] == "fleetrl: Dynamo worker 7 (dynamo-worker-0) replaced by dynamo-worker-1"
    stranger = WorkerInfo(id="8", data_url="http://f", admin_url="http://127.0.0.1:9003")
    assert await provider.restart(stranger) is None  # never seen serving, no process found: said, not guessed
    assert "Dynamo worker 8 not restarted: no worker process this run launched serves it" in logged[-1]
    await provider.close()


async def test_a_replacement_that_exits_before_it_registers_fails_its_restart(tmp_path, monkeypatch):
    """The restart of a Dynamo worker lasts until its replacement is listed: one that exits
    first fails it, so that a fleet left with no live worker is not told one is coming (it
    waited inference.no_worker_timeout_s for an instance that would never register)."""
    from types import SimpleNamespace

    from fleetrl.inference.dynamo import provider as dynamo_provider
    from fleetrl.inference.types import WorkerInfo

    serving = SimpleNamespace(name="dynamo-worker-0")
    exited = SimpleNamespace(name="dynamo-worker-1", alive=lambda: False, popen=SimpleNamespace(returncode=1),
                             log_path=tmp_path / "dynamo-worker-1.log", log_tail=lambda: "ImportError: no dynamo")

    class Deployment:
        workers = [serving]

        def live_worker_at(self, admin_url):
            return serving

        def replace_worker(self, process):
            return exited

        def stop(self):
            pass

    async def listed(*args):
        return [WorkerInfo(id="7", data_url="http://f", admin_url="http://127.0.0.1:9001")]

    provider = dynamo_provider.DynamoProvider(InferenceConfig(provider="dynamo"), tmp_path, tmp_path, "r1",
                                              log=lambda line: None)
    provider.deployment, provider._rl_url = Deployment(), "http://rl"
    monkeypatch.setattr(dynamo_provider, "list_rl_workers", listed)
    [worker] = await provider.discover()
    with pytest.raises(FleetrlError, match="^dynamo-worker-1 exited during startup \\(code 1\\)"):
        await provider.restart(worker)
    await provider.close()
