"""Dynamo as a cluster runs it, with real processes: etcd discovery (workers registered under
leases) and a NATS event plane.

One deployment that fleetrl did not start — etcd, NATS, a frontend and two of Dynamo's vLLM
workers behind fleetrl's worker entry, started by deploy/dynamo/start_etcd_deployment.py as an
operator would — which fleetrl attaches to and finds through etcd; it is the session pool's
(deployments.py), stopped however the module ends. fleetrl's own launch mode (it starts etcd
and NATS itself) is driven end to end by the torchrun-dynamo run of runs.py (test_rl_e2e.py).
"""

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass

import httpx
import psutil
import pytest
import pytest_asyncio

from fleetrl.app.providers import base_weights as base_weights_of
from fleetrl.config import DynamoConfig, InferenceConfig
from fleetrl.inference.dynamo.cluster import find_binary
from fleetrl.inference.dynamo.launcher import WORKER_PREFIX
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import GenerateRequest, SamplingParams, WorkerRole, WorkerState
from fleetrl.processes import running_groups
from fleetrl.records import WorkerEvent
from fleetrl.versions import VersionSpan, new_run_id
from fleetrl.weights.factory import make_transport

from .conftest import ENGINE_CORE, chat_ids, model_with, perturbed
from .deployments import DYNAMO_ETCD, LEASE_TTL_S, DynamoDeployment, deploy
from .probes import probe_fleet

pytestmark = [pytest.mark.deployment(DYNAMO_ETCD), pytest.mark.asyncio(loop_scope="module")]

MAX_TOKENS = 8


def etcdctl(endpoint: str, *args: str) -> str:
    out = subprocess.run([find_binary("etcdctl"), "--endpoints", endpoint, *args], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def registered_in_etcd(endpoint: str) -> set[str]:
    """The workers registered in etcd, as fleetrl names them: each worker's RL endpoint is the key
    v1/instances/<namespace>/<component>/rl/<lease id, hex>, and its lease id is its Dynamo
    instance id (decimal in RL discovery)."""
    keys = etcdctl(endpoint, "get", "--prefix", "--keys-only", "v1/instances/fleetrl/").split()
    return {str(int(key.rsplit("/", 1)[1], 16)) for key in keys if key.split("/")[-2] == "rl"}


async def nats_clients(monitor_url: str) -> int:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{monitor_url}/connz")).json()["num_connections"]


async def eventually(condition, timeout_s: float, what: str, every_s: float = 0.5) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what} not within {timeout_s:g} s"
        await asyncio.sleep(every_s)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def deployment(deployments, model_dir) -> DynamoDeployment:
    """etcd, NATS, a frontend and two workers that fleetrl does not own (deployments.py)."""
    return deployments.dynamo_etcd(model_dir)


@dataclass
class Attached:
    fleet: Fleet
    transport: object  # the run's broadcast sender: base weights, publishes, refits
    logs: list[str]  # the fleet's log lines
    events: list[dict]  # its state changes and fences


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def attached(deployment, model_dir, tmp_path_factory):
    """fleetrl attached to the deployment as a run is (frontend URL and RL discovery URL alone),
    with the discovery loop of a run: every 5 s."""
    record = deployment.record
    config = InferenceConfig(provider="dynamo", admin_timeout_s=120,
                             dynamo=DynamoConfig(frontend_url=record["frontend_url"], rl_url=record["rl_url"]))
    provider = DynamoProvider(config, model_dir, tmp_path_factory.mktemp("attached-run"), new_run_id())
    transport = make_transport("broadcast", host="127.0.0.1", bucket_bytes=32 << 20,
                               storage_dir=tmp_path_factory.mktemp("weights"))
    logs, events = [], []
    fleet = Fleet(provider, pause_mode=config.resolved_pause_mode(), discovery_interval_s=5.0, log=logs.append,
                  on_event=events.append)
    try:
        await fleet.start(base_weights_of(provider, model_dir, transport))
        yield Attached(fleet, transport, logs, events)
    finally:
        await fleet.close()
        await transport.close()


async def sample(fleet: Fleet, tokenizer, count: int):
    """`count` requests at once (the fleet spreads them over the least busy workers)."""
    request = GenerateRequest(chat_ids(tokenizer, "Name a river."), SamplingParams(max_tokens=MAX_TOKENS))
    return [out for (out,) in await asyncio.gather(*(fleet.generate(request) for _ in range(count)))]


async def test_attached_through_etcd_the_workers_are_ready_at_v0(deployment, attached, tokenizer):
    fleet, record = attached.fleet, deployment.record
    assert len(fleet.workers) == 2
    # The workers fleetrl found are exactly the ones registered in etcd.
    assert set(fleet.workers) == registered_in_etcd(record["etcd_endpoint"])
    for worker in fleet.workers.values():
        assert worker.state == WorkerState.READY and worker.version == 0 and worker.role == WorkerRole.AGGREGATED
        admin = fleet.provider.admin(worker)
        assert await admin.version() == 0
        # Started by someone else, each was held to the run's base weights before being labelled v0.
        await admin.verify_weights(fleet.checksum)
    # The NATS event plane is in use: the frontend and both workers are its clients.
    assert await nats_clients(record["nats_monitor"]) >= 3
    outs = await sample(fleet, tokenizer, 4)
    assert all(o.spans == [VersionSpan(0, 0)] and 0 < len(o.token_ids) <= MAX_TOKENS for o in outs)


async def test_the_operator_scripts_workers_run_on_cpus_of_their_own(deployment):
    """Each worker on CPUs of its own, its engine core included (its model runs there: no worker
    process of its own), with one engine thread per CPU."""
    workers = [psutil.Process(p["pid"]) for p in deployment.record["processes"] if p["name"].startswith(WORKER_PREFIX)]
    cpus = [{tuple(p.cpu_affinity()) for p in (w, *w.children(recursive=True))} for w in workers]
    assert len(workers) == 2 and all(len(each) == 1 for each in cpus) and len(set.union(*cpus)) == 2, cpus
    names = [p.name() for w in workers for p in w.children(recursive=True)]
    assert names.count(ENGINE_CORE) == 2 and "VLLM::Worker" not in names, names
    threads = [w.environ()["OMP_NUM_THREADS"] for w in workers]
    assert threads == [str(len(c)) for (c,) in cpus], threads


async def test_a_publish_reaches_every_worker_found_through_etcd(attached, base_weights, tokenizer):
    fleet = attached.fleet
    report = await fleet.publish(1, attached.transport, perturbed(base_weights, seed=1))
    assert sorted(report.ready) == sorted(fleet.workers) and not report.failed, report
    for worker in fleet.workers.values():
        admin = fleet.provider.admin(worker)
        assert worker.state == WorkerState.READY and await admin.version() == 1
        await admin.verify_weights(report.checksum)
    outs = await sample(fleet, tokenizer, 4)
    assert {o.worker_id for o in outs} == set(fleet.workers)
    assert all(o.spans == [VersionSpan(1, 0)] for o in outs)


async def test_a_sigkilled_worker_is_dead_and_leaves_etcd_when_its_lease_expires(deployment, attached, tokenizer):
    fleet, endpoint = attached.fleet, deployment.record["etcd_endpoint"]
    victim, survivor = fleet.ready_workers()
    lease = f"{int(victim.id):x}"
    assert f"TTL({LEASE_TTL_S}s)" in etcdctl(endpoint, "lease", "timetolive", lease)
    os.killpg(deployment.worker_group(victim.admin_url), signal.SIGKILL)  # the whole worker: engine core too
    # Killed, it withdrew nothing: only its lease, no longer kept alive, can remove it.
    assert victim.id in registered_in_etcd(endpoint)
    dead_after = await eventually(lambda: fleet.workers[victim.id].state == WorkerState.DEAD, 20,
                                  "the fleet's discovery loop marking the worker dead")
    gone_after = await eventually(lambda: victim.id not in registered_in_etcd(endpoint), LEASE_TTL_S + 10,
                                  "the worker's registration leaving etcd")
    assert "expired" in etcdctl(endpoint, "lease", "timetolive", lease)
    print(f"SIGKILLed worker: dead in the fleet after {dead_after:.1f} s ({fleet.workers[victim.id].error}), "
          f"gone from etcd after {gone_after:.1f} s")
    async with httpx.AsyncClient() as client:  # and from the frontend's RL discovery altogether
        listed = (await client.get(f"{deployment.record['rl_url']}/v1/rl/workers")).json()["workers"]
    assert [str(w["instance_id"]) for w in listed] == [survivor.id]
    await asyncio.sleep(6)  # a discovery round later, it stays dead and the survivor serves alone
    assert fleet.workers[victim.id].state == WorkerState.DEAD and fleet.ready_workers() == [survivor]
    outs = await sample(fleet, tokenizer, 2)
    assert all(o.worker_id == survivor.id and o.spans == [VersionSpan(1, 0)] for o in outs)


async def test_a_worker_that_registers_is_refitted_to_the_fleets_version_before_it_serves(
        deployment, attached, base_weights, probe, tokenizer):
    fleet = attached.fleet
    known, seen = set(fleet.workers), len(attached.events)
    added = deploy("add-worker", str(deployment.root), timeout=60)
    assert added.returncode == 0, added.stderr

    def joined() -> list[str]:
        return [w for w in fleet.workers if w not in known]

    await eventually(lambda: joined() and fleet.workers[joined()[0]].state == WorkerState.READY, 600,
                     "the new worker ready", every_s=2)
    (new,) = joined()
    assert new in registered_in_etcd(deployment.record["etcd_endpoint"])
    # Quarantined first: seen holding no version, it was paused and sent v1's weights, and was
    # never ready before that.
    assert (f"fleetrl: worker {new} holds no version of this run (another run's, or none), not v1: refitting it "
            "with the weights of v1") in attached.logs
    states = [e.state for e in attached.events[seen:] if isinstance(e, WorkerEvent) and e.worker == new]
    assert states[0] == "syncing" and states[-1] == "ready" and states.count("ready") == 1, states
    admin = fleet.provider.admin(fleet.workers[new])
    assert await admin.version() == 1
    await admin.verify_weights(fleet.checksum)
    for r in await probe_fleet(fleet, model_with(base_weights, perturbed(base_weights, seed=1)), probe):
        assert r.max_abs_diff < 2e-3, r
    outs = await sample(fleet, tokenizer, 4)
    assert new in {o.worker_id for o in outs} and all(o.spans == [VersionSpan(1, 0)] for o in outs)


async def test_the_stop_command_leaves_no_process(deployment, attached):
    processes = deployment.record["processes"]
    assert [p["name"] for p in processes][:3] == ["etcd", "nats", "dynamo-frontend"] and len(processes) == 6
    stopped = deploy("stop", str(deployment.root), timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not {p["pid"] for p in processes} & running_groups()
    async with httpx.AsyncClient() as client:
        for url in (deployment.record["etcd_endpoint"] + "/health", deployment.record["frontend_url"] + "/v1/models"):
            with pytest.raises(httpx.ConnectError):
                await client.get(url)
