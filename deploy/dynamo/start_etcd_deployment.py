"""A Dynamo deployment on etcd discovery (and NATS), started as an operator starts one beside
fleetrl: processes that fleetrl does not own, which fleetrl then attaches to.

    python deploy/dynamo/start_etcd_deployment.py start DIR [--model MODEL_DIR] [--workers 2]
        [--prefill-workers 0] [--worker-kind dynamo|fleetrl] [--event-plane nats|zmq]
        [--lease-ttl SECONDS] [--max-model-len 512] [--host 127.0.0.1] [--namespace fleetrl]
    python deploy/dynamo/start_etcd_deployment.py add-worker DIR [--prefill]
    python deploy/dynamo/start_etcd_deployment.py stop DIR

`start` launches etcd, NATS (with the nats event plane, the default here, as on a cluster), a
frontend with RL discovery and the workers — fleetrl's worker entry, `python -m
fleetrl.engine.dynamo_worker`, with the engine arguments of `fleetrl.contract`, so the weight
transfer backend is in every worker. Each runs in a session of its own, logs to DIR/logs and
lives on after this script exits. `start` returns once the frontend lists every worker and
serves a completion on each; DIR/deployment.json records the URLs, the settings and every
process (pid and start time), and the settings with which fleetrl attaches are printed.
`add-worker` starts one more worker, which registers in etcd and joins on its own. `stop`
ends every recorded process group (SIGTERM, then SIGKILL after STOP_GRACE_S): the workers and
the frontend first, then NATS and etcd.

The command lines and environments are the ones fleetrl's own launcher uses, built by the
same functions (fleetrl.inference.dynamo.launcher and .cluster), so an attached deployment is
the deployment fleetrl tests. With two workers or more, each worker's engine threads are bound
to CPUs of their own, as run.core_plan binds the workers fleetrl launches (an added worker
takes the next share, cycled). Every listener binds --host (loopback by default): the system
ports of Dynamo's own worker kind carry admin routes without authentication (docs/dynamo.md,
"Protecting the system port"). `--worker-kind fleetrl` needs $FLEETRL_ADMIN_TOKEN, which its
workers take in their environment and fleetrl attaches with.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from fleetrl.config import DynamoConfig, InferenceConfig, ModelConfig, VllmConfig
from fleetrl.contract import ADMIN_TOKEN_ENV
from fleetrl.cores import plan_cores
from fleetrl.errors import FleetrlError
from fleetrl.files import atomic_write
from fleetrl.inference.dynamo.cluster import ClusterServices, start_etcd, start_nats, wait_answering
from fleetrl.inference.dynamo.launcher import (PREFILL_PREFIX, WORKER_PREFIX, DynamoDeployment, check_system_host,
                                               deployment_env, frontend_argv, frontend_env,
                                               wait_ready, worker_argv, worker_env)
from fleetrl.model import resolve_model
from fleetrl.processes import ManagedProcess, end_groups, free_port, owned_group, running_groups, started_at
from fleetrl.rundir import DeploymentPaths

RECORD = "deployment.json"
STOP_GRACE_S = 10.0  # a worker withdraws its etcd registration as it stops
STARTUP_TIMEOUT_S = 900.0
SERVICES = {"etcd", "nats"}  # the names cluster.start_etcd / start_nats give their processes


class Deployment:
    """DIR/deployment.json: what was started, rewritten after every process so that `stop`
    finds everything even when `start` failed half way."""

    def __init__(self, root: Path, record: dict) -> None:
        self.root = root
        self.record = record

    @classmethod
    def load(cls, root: Path) -> "Deployment":
        path = root / RECORD
        if not path.exists():
            raise FleetrlError(f"no deployment recorded in {root} ({RECORD} is missing)")
        return cls(root, json.loads(path.read_text()))

    def save(self) -> None:
        atomic_write(self.root / RECORD, json.dumps(self.record, indent=2))

    def config(self) -> InferenceConfig:
        """The inference settings of this deployment, as fleetrl's launcher reads them: etcd and
        NATS named once started (so none is launched), etcd's lease TTL for every Dynamo process."""
        s = self.record["settings"]
        env = {"NATS_SERVER": self.record["nats_server"]} if self.record.get("nats_server") else {}
        if s["lease_ttl"]:
            env["ETCD_LEASE_TTL"] = str(s["lease_ttl"])
        # Two workers or more: each one on CPUs of its own, as run.core_plan does.
        engines = s["workers"] + s["prefill_workers"]
        cpus = plan_cores(sorted(os.sched_getaffinity(0)), engines, 0).workers if engines > 1 else []
        return InferenceConfig(
            provider="dynamo", host=s["host"], workers=s["workers"],
            vllm=VllmConfig(max_model_len=s["max_model_len"], omp_threads_bind=cpus),
            dynamo=DynamoConfig(worker=s["worker_kind"], namespace=s["namespace"], prefill_workers=s["prefill_workers"],
                                discovery="etcd", etcd_endpoints=[self.record["etcd_endpoint"]] if
                                "etcd_endpoint" in self.record else [],
                                event_plane=s["event_plane"], env=env,
                                allow_unauthenticated_admin=s["allow_unauthenticated_admin"]))

    def start(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
              cpus: list[int] = ()) -> ManagedProcess:
        """`argv` in a session of its own, not a child that dies with this script, on `cpus` where
        given; recorded."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, start_new_session=True,
                                     preexec_fn=functools.partial(os.sched_setaffinity, 0, cpus) if cpus else None)
        self.record["processes"].append({"name": name, "pid": popen.pid,
                                         "started_at": started_at(popen.pid)})
        self.save()
        return ManagedProcess(name, popen, log_path, started_at(popen.pid))

    def add_worker(self, prefill: bool) -> ManagedProcess:
        config = self.config()
        index = self.record["workers_started"]
        name = f"{PREFILL_PREFIX if prefill else WORKER_PREFIX}{index}"
        self.record["workers_started"] += 1
        return self.start(name, worker_argv(Path(self.record["settings"]["model"]), config, self.root, prefill),
                          DeploymentPaths(self.root).log(name),
                          {**worker_env(config, DeploymentPaths(self.root).discovery), **config.vllm.engine_env(index)},
                          config.vllm.engine_cpus(index))


async def start(root: Path, args: argparse.Namespace) -> Deployment:
    root.mkdir(parents=True, exist_ok=True)
    if (root / RECORD).exists() and any(live_group(p) for p in Deployment.load(root).record["processes"]):
        raise FleetrlError(f"{root} holds a running deployment: stop it first")
    model = Path(args.model) if args.model else resolve_model(ModelConfig())
    deployment = Deployment(root, {
        "settings": {"model": str(model.resolve()), "workers": args.workers, "prefill_workers": args.prefill_workers,
                     "worker_kind": args.worker_kind, "event_plane": args.event_plane, "lease_ttl": args.lease_ttl,
                     "max_model_len": args.max_model_len, "host": args.host, "namespace": args.namespace,
                     "allow_unauthenticated_admin": args.allow_unauthenticated_admin},
        "processes": [], "workers_started": 0})
    deployment.save()
    # Before anything starts: workers' admin routes beyond loopback only when the operator says so.
    check_system_host(deployment.config(), deployment_env(deployment.config(), DeploymentPaths(root).discovery))
    try:
        services = ClusterServices(start_etcd(root, deployment.start),
                                   start_nats(root, deployment.start) if args.event_plane == "nats" else None)
        await wait_answering(services, STARTUP_TIMEOUT_S)
        deployment.record.update(etcd_endpoint=services.etcd.url, nats_server=services.nats and services.nats.url,
                                 nats_monitor=services.nats and services.nats.monitor_url)
        config = deployment.config()
        http_port, rl_port = free_port(args.host), free_port(args.host)
        frontend = deployment.start("dynamo-frontend", frontend_argv(config, http_port),
                                    DeploymentPaths(root).log("dynamo-frontend"),
                                    frontend_env(config, DeploymentPaths(root).discovery, rl_port))
        deployment.record.update(frontend_url=f"http://{args.host}:{http_port}", rl_url=f"http://{args.host}:{rl_port}")
        workers = [deployment.add_worker(prefill=False) for _ in range(args.workers)]
        workers += [deployment.add_worker(prefill=True) for _ in range(args.prefill_workers)]
        # The readiness check of fleetrl's launcher: every worker listed, a completion on each.
        await wait_ready(DynamoDeployment(deployment.record["frontend_url"], deployment.record["rl_url"], frontend,
                                          workers, model, config, root, cluster=services),
                         len(workers), STARTUP_TIMEOUT_S)
    except BaseException:
        stop(deployment)
        raise
    return deployment


def live_group(process: dict) -> bool:
    """Whether the process group of a recorded process (its leader: each was started in a
    session of its own) still has a running process. A leader that runs must be the one recorded,
    not a later process that reuses its pid; a gone leader's pid is not reused while its group
    lives on (a worker's engine core, say)."""
    return process["pid"] in running_groups() and owned_group(process["pid"], process["started_at"])


def stop(deployment: Deployment) -> None:
    """Stop every recorded process group that still runs: the workers and the frontend, then
    NATS and etcd (a stopping worker withdraws its registration from etcd)."""
    live = [p for p in reversed(deployment.record["processes"]) if live_group(p)]
    end_or_raise([p["pid"] for p in live if p["name"] not in SERVICES])
    end_or_raise([p["pid"] for p in live if p["name"] in SERVICES])


def end_or_raise(groups: list[int]) -> None:
    """SIGTERM the process groups, then SIGKILL what is left of them after STOP_GRACE_S."""
    left = end_groups(groups, STOP_GRACE_S)
    if left:
        raise FleetrlError(f"process groups {left} still run after SIGKILL")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    begin = commands.add_parser("start", help="start etcd, NATS, a frontend and the workers")
    begin.add_argument("dir", type=Path, help="the deployment's folder: record, logs, etcd and NATS data")
    begin.add_argument("--model", help="HF model folder the workers serve (default: fleetrl's embedded model)")
    begin.add_argument("--workers", type=int, default=2, help="aggregated (or, with prefill workers, decode) workers")
    begin.add_argument("--prefill-workers", type=int, default=0)
    begin.add_argument("--worker-kind", choices=["dynamo", "fleetrl"], default="dynamo",
                       help="inference.dynamo.worker of the fleetrl that attaches")
    begin.add_argument("--event-plane", choices=["nats", "zmq"], default="nats",
                       help="nats: KV events and metrics through the NATS server started here")
    begin.add_argument("--lease-ttl", type=int, default=0,
                       help="etcd lease TTL of every Dynamo process (ETCD_LEASE_TTL); 0 = Dynamo's default, 30 s")
    begin.add_argument("--max-model-len", type=int, default=512)
    begin.add_argument("--host", default="127.0.0.1", help="address every listener binds")
    begin.add_argument("--allow-unauthenticated-admin", action="store_true",
                       help="allow a --host beyond loopback: the workers' admin routes take no token, so the "
                       "network must let only the trainer reach them (docs/dynamo.md)")
    begin.add_argument("--namespace", default="fleetrl", help="Dynamo namespace (DYN_NAMESPACE)")
    grow = commands.add_parser("add-worker", help="start one more worker; it joins through etcd")
    grow.add_argument("dir", type=Path)
    grow.add_argument("--prefill", action="store_true", help="a prefill worker")
    end = commands.add_parser("stop", help="stop every process of the deployment")
    end.add_argument("dir", type=Path)
    args = parser.parse_args()
    try:
        if args.command == "start":
            if args.worker_kind == "fleetrl" and not os.environ.get(ADMIN_TOKEN_ENV):
                raise FleetrlError(f"--worker-kind fleetrl needs ${ADMIN_TOKEN_ENV}: fleetrl's worker kind takes only "
                                   "admin calls signed with it (fleetrl attaches with the same token)")
            record = asyncio.run(start(args.dir, args)).record
            attach = ["--inference.provider", "dynamo", "--inference.dynamo.frontend_url", record["frontend_url"],
                      "--inference.dynamo.rl_url", record["rl_url"]]
            if args.worker_kind == "fleetrl":
                attach += ["--inference.dynamo.worker", "fleetrl"]
            print(f"deployment ready (etcd {record['etcd_endpoint']}, NATS {record['nats_server'] or 'not used'}); "
                  f"recorded in {args.dir / RECORD}\nfleetrl attaches with: {' '.join(attach)}\n"
                  f"stop it with: {sys.executable} {sys.argv[0]} stop {args.dir}")
        elif args.command == "add-worker":
            deployment = Deployment.load(args.dir)
            worker = deployment.add_worker(args.prefill)
            print(f"started {worker.name} (pid {worker.pid}, log {worker.log_path}); it joins through etcd")
        else:
            stop(Deployment.load(args.dir))
            print(f"stopped the deployment in {args.dir}")
    except FleetrlError as e:
        sys.exit(f"start_etcd_deployment: {e}")


if __name__ == "__main__":
    main()
