"""Deployments that several test modules share, so the suite starts each once (issue 26).

A module declares the deployment it uses with `pytest.mark.deployment(NAME)`; collection puts
the modules of one deployment next to each other (conftest.py), the deployment starts when the
first of their tests asks for it, and it is stopped as soon as the next test to run does not
use it, so at most one is alive at a time and no other module runs beside its processes.

Sharing is sound because each user either restores what it changed or leaves what an attached
run must recover anyway: a fleet attached by URL brings every worker back to the base weights
(checksum, then the agreement probe) before it labels it v0.

OPERATOR_SERVERS: two native vLLM servers started by the quickstart's own commands, as an
operator would (docs/quickstart.md, section 6), so no run of fleetrl owns them. Used by
test_weight_transfer.py (its tests publish into the first and restore the base weights),
test_conformance.py, and then test_kill_points.py (the quickstart's attached run on both, the
kill-point sequence on the first, which kills nothing but fleetrl).

DYNAMO_ETCD: etcd, NATS, a Dynamo frontend and two of Dynamo's vLLM workers, started by
deploy/dynamo/start_etcd_deployment.py as an operator would. Used by test_dynamo_etcd.py, whose
last test stops it with the script's own stop command.

The fleets that fleetrl itself launches (test_providers.py, test_dynamo_disaggregated.py, the
runs of runs.py) are what those tests test, so each module starts its own; the pool stops the
deployment alive before them, so none runs beside them either.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV
from fleetrl.processes import free_port, listening_ports, running_groups

from tests.documented import ROOT, documented

OPERATOR_SERVERS = "operator-servers"
DYNAMO_ETCD = "dynamo-etcd"

# The tokens the operator started the servers with; a run attached to them must hold the same.
ADMIN, DATA = "operator-admin-token", "operator-data-token"

# The quickstart's two server commands, each on CPUs of its own (tests/documented.py: only
# their ports are changed here).
SERVE = ("VLLM_CPU_OMP_THREADS_BIND=0 VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m "
         'vllm.entrypoints.openai.api_server --model "$(.venv/bin/fleetrl model)" --served-model-name policy '
         "--host 127.0.0.1 --port 8001 --dtype float32 --max-model-len 512 --enforce-eager --enable-scale-out "
         "--middleware fleetrl.engine.admin_auth.AdminTokenMiddleware "
         "--worker-extension-cls fleetrl.engine.worker_extension.FleetrlWorkerExtension "
         "--weight-transfer-config '{\"backend\": \"fleetrl\"}'",
         "VLLM_CPU_OMP_THREADS_BIND=1 VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m "
         'vllm.entrypoints.openai.api_server --model "$(.venv/bin/fleetrl model)" --served-model-name policy '
         "--host 127.0.0.1 --port 8002 --dtype float32 --max-model-len 512 --enforce-eager --enable-scale-out "
         "--middleware fleetrl.engine.admin_auth.AdminTokenMiddleware "
         "--worker-extension-cls fleetrl.engine.worker_extension.FleetrlWorkerExtension "
         "--weight-transfer-config '{\"backend\": \"fleetrl\"}'")


# The Dynamo deployment's operator script, and the lease its workers register under (the
# deployment's ETCD_LEASE_TTL; Dynamo's default is 30 s).
DEPLOY_SCRIPT = ROOT / "deploy" / "dynamo" / "start_etcd_deployment.py"
LEASE_TTL_S = 10


def deploy(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """The Dynamo deployment's operator script, run with `args`."""
    return subprocess.run([sys.executable, str(DEPLOY_SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)


@dataclass
class DynamoDeployment:
    """What start_etcd_deployment.py started in `root`."""

    root: Path

    @property
    def record(self) -> dict:  # read anew: add-worker appends to it
        return json.loads((self.root / "deployment.json").read_text())

    def worker_group(self, admin_url: str) -> int:
        """The process group (its leader's pid) of the worker whose system server is at `admin_url`."""
        port = int(admin_url.rsplit(":", 1)[1])
        (pid,) = [p["pid"] for p in self.record["processes"] if port in listening_ports(p["pid"])]
        return pid


@contextmanager
def dynamo_deployment(root: Path, model_dir: Path):
    """The operator script's deployment of two workers, stopped by its stop command however the
    block ends (and any recorded group still alive then, killed)."""
    try:
        started = deploy("start", str(root), "--model", str(model_dir), "--workers", "2",
                         "--lease-ttl", str(LEASE_TTL_S), "--max-model-len", "512")
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        assert "fleetrl attaches with: --inference.provider dynamo" in started.stdout
        yield DynamoDeployment(root)
    finally:
        stopped = deploy("stop", str(root), timeout=120)
        if (root / "deployment.json").exists():
            for process in json.loads((root / "deployment.json").read_text())["processes"]:
                if process["pid"] in running_groups():
                    os.killpg(process["pid"], signal.SIGKILL)
        assert stopped.returncode == 0, stopped.stderr


def _term_with_parent() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    # As from a terminal: a test runner started as a background job (`cmd &`) ignores
    # SIGINT, and a child would inherit that, so Ctrl-C tests would test nothing.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def started(command: str, log_path: Path, env: dict | None = None):
    """A quickstart server command, run until the block ends (its whole session stopped then,
    however the block ends)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True, preexec_fn=_term_with_parent)
    try:
        yield proc
    finally:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                pass


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + 600
    while True:
        assert proc.poll() is None, f"the server for {url} exited: {log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{url} not healthy in time: {log_path.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)


@contextmanager
def serving(command: str, url: str, log_path: Path, env: dict | None = None):
    """`started`, and answering /health before the block starts."""
    with started(command, log_path, env) as proc:
        wait_healthy(proc, url, log_path)
        yield proc


class DeploymentPool:
    """The session's shared deployments, at most one alive at a time."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.name: str | None = None  # the deployment alive now
        self.urls: list[str] = []
        self.dynamo: DynamoDeployment | None = None
        self._stack = ExitStack()

    def operator_servers(self) -> list[str]:
        """The two operator-started servers' URLs, started on first use."""
        if self.name != OPERATOR_SERVERS:
            self.release()
            ports = [free_port("127.0.0.1"), free_port("127.0.0.1")]
            tokens = {ADMIN_TOKEN_ENV: ADMIN, DATA_TOKEN_ENV: DATA}
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            try:
                # Both start at once, as from an operator's two terminals, and are waited for after.
                procs = [self._stack.enter_context(started(documented(serve, replace={f"800{i + 1}": str(port)}),
                                                           self.logs / f"server-{i}.log", tokens))
                         for i, (serve, port) in enumerate(zip(SERVE, ports))]
                for i, (proc, url) in enumerate(zip(procs, urls)):
                    wait_healthy(proc, url, self.logs / f"server-{i}.log")
            except BaseException:
                self._stack.close()
                raise
            self.name, self.urls = OPERATOR_SERVERS, urls
        return self.urls

    def dynamo_etcd(self, model_dir: Path) -> DynamoDeployment:
        """The operator's Dynamo deployment with etcd and NATS, started on first use."""
        if self.name != DYNAMO_ETCD:
            self.release()
            self.dynamo = self._stack.enter_context(dynamo_deployment(self.logs / DYNAMO_ETCD, model_dir))
            self.name = DYNAMO_ETCD
        return self.dynamo

    def release(self) -> None:
        """Stop the deployment alive now, if any."""
        self._stack.close()
        self.name, self.urls, self.dynamo = None, [], None


def deployment_of(item) -> str | None:
    """The deployment a collected test declared (pytest.mark.deployment), if any."""
    marker = item.get_closest_marker("deployment")
    return marker.args[0] if marker else None
