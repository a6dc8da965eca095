"""The native provider: vLLM servers that fleetrl launches, or attaches to by URL.

A native vLLM server is one worker: it serves the data plane and its own admin routes on one
port, so discovery is the list of servers. A worker's id is stable across re-discovery: the
launch name for launched servers, the URL for attached ones.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fleetrl.config import InferenceConfig
from fleetrl.errors import FleetrlError
from fleetrl.inference.types import GenerateRequest, GenerateResponse, WorkerInfo
from fleetrl.inference.vllm.admin import VllmAdminClient
from fleetrl.inference.vllm.data import VllmDataClient
from fleetrl.inference.vllm.launcher import LaunchedServer, launch_vllm_servers


class VllmProvider:
    name = "vllm"

    def __init__(self, config: InferenceConfig, model_dir: Path, log_dir: Path, token: str,
                 log=print) -> None:
        self.config = config
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.token = token
        self.log = log
        self.launched: list[LaunchedServer] = []
        self._admins: dict[str, VllmAdminClient] = {}
        self._data = VllmDataClient(token, config.request_timeout_s)

    async def start(self) -> None:
        if self.config.urls:
            workers = await self.discover()
            healthy = await asyncio.gather(*(self.admin(w).health() for w in workers))
            down = [w.admin_url for w, ok in zip(workers, healthy) if not ok]
            if down:
                raise FleetrlError(f"inference.urls: cannot reach {', '.join(down)} (no answer on /health)")
            return
        self.launched = await launch_vllm_servers(
            self.model_dir, self.config, self.config.workers, self.log_dir, self.token, self.log
        )

    async def discover(self) -> list[WorkerInfo]:
        if self.config.urls:
            return [_worker(url.rstrip("/"), url.rstrip("/")) for url in self.config.urls]
        # A launched server that exited is gone from discovery; the coordinator marks it dead.
        return [_worker(s.name, s.url) for s in self.launched if s.process.alive()]

    async def generate(self, worker: WorkerInfo, request: GenerateRequest, prompt_suffix: list[int] = (),
                       prefill: WorkerInfo | None = None) -> list[GenerateResponse]:
        if prefill is not None:
            raise FleetrlError(f"the vllm provider has no prefill workers (asked to prefill on {prefill.id})")
        return await self._data.generate(worker.id, worker.data_url, request, prompt_suffix)

    async def prompt_logprobs(self, worker: WorkerInfo, token_ids: list[int],
                              prefill: WorkerInfo | None = None) -> list[float]:
        if prefill is not None:
            raise FleetrlError(f"the vllm provider has no prefill workers (asked to prefill on {prefill.id})")
        return await self._data.prompt_logprobs(worker.id, worker.data_url, token_ids)

    def admin(self, worker: WorkerInfo) -> VllmAdminClient:
        if worker.id not in self._admins:
            self._admins[worker.id] = VllmAdminClient(
                worker.id, worker.admin_url, self.token, self.config.admin_timeout_s, self.config.admin_retries
            )
        return self._admins[worker.id]

    def stop_worker(self, worker_id: str) -> None:
        """Stop one launched server at once (a worker that misbehaves; failure tests)."""
        for server in self.launched:
            if server.name == worker_id:
                server.process.stop(grace_s=0)

    async def close(self) -> None:
        for admin in self._admins.values():
            await admin.close()
        self._admins.clear()
        await self._data.close()
        for server in self.launched:
            server.process.stop()


def _worker(worker_id: str, url: str) -> WorkerInfo:
    """A native server serves requests and its admin routes on one port."""
    return WorkerInfo(id=worker_id, data_url=url, admin_url=url)
