"""The native provider: vLLM servers that fleetrl launches, or attaches to by URL.

A native vLLM server is one worker: it serves the data plane and its own admin routes on one
port, so discovery is the list of servers. A worker's id is stable across re-discovery: the
launch name for launched servers, the URL for attached ones.

Two tokens (engine/admin_auth.py): the data client sends the data token, the admin clients
the admin token. An attached server must guard its admin routes with fleetrl's middleware and
hold the same tokens; `start` checks both before the fleet uses it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from fleetrl.config import InferenceConfig
from fleetrl.contract import ADMIN_MIDDLEWARE, ADMIN_TOKEN_ENV, DATA_TOKEN_ENV, INSTANCE_PATH
from fleetrl.errors import FleetrlError
from fleetrl.inference.answers import vocab_size
from fleetrl.inference.http import SERVED_MODEL_NAME, RunClaim, announced_instance, answered_within, sign, unproven
from fleetrl.inference.types import GenerateRequest, GenerateResponse, WorkerInfo
from fleetrl.inference.vllm.admin import VllmAdminRoutes, VllmWorkerControl
from fleetrl.inference.vllm.data import VllmDataClient
from fleetrl.inference.vllm.launcher import LaunchedServer, launch_vllm_servers, start_server, wait_healthy
from fleetrl.inference.vllm.weight_sync import VllmWeightSync
from fleetrl.lora import ADAPTER_NAME, AdapterSpec
from fleetrl.processes import stop_groups


# What an attached server is asked at start: an admin route that only reads (and must refuse a
# caller without the admin token), and a data route that only reads.
ADMIN_CHECK_PATH = "/is_paused"
DATA_CHECK_PATH = "/v1/models"
REFUSED = (401, 403)


class VllmProvider:
    name = "vllm"

    def __init__(self, config: InferenceConfig, model_dir: Path | None, log_dir: Path, admin_token: str,
                 data_token: str | None, run: str | None, log=print, adapter: AdapterSpec | None = None) -> None:
        """`run`: the run whose versions the workers are labelled with and which holds them
        (`RunDir.run_id`). `data_token` and `run` None: a provider that only reads the workers'
        state (`fleetrl status`). `adapter`: a LoRA run's adapter, which launched servers are
        started with and every request is served through (attached servers must have been
        started so: docs/quickstart.md)."""
        self.config = config
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.admin_token = admin_token
        self.data_token = data_token
        self.log = log
        self.launched: list[LaunchedServer] = []
        self.launches_workers = not config.attaches()
        self._clients: dict[str, tuple[VllmWorkerControl, VllmWeightSync]] = {}  # by worker id
        self.run = run
        self._claim = RunClaim(run, config.claim_lease_s) if run is not None else None
        self.adapter = adapter
        self._data = VllmDataClient(data_token, config.request_timeout_s, run, admin_token=admin_token,
                                    model=ADAPTER_NAME if adapter else SERVED_MODEL_NAME,
                                    vocab_size=vocab_size(model_dir) if model_dir is not None else None)

    async def start(self) -> None:
        if self.config.urls:
            workers = await self.discover()
            async with httpx.AsyncClient(timeout=self.config.admin_timeout_s) as client:
                refusals = await asyncio.gather(*(self._why_unusable(client, w.admin_url) for w in workers))
            for refusal in refusals:
                if refusal:
                    raise FleetrlError(f"inference.urls: {refusal}")
            return
        self.launched = await launch_vllm_servers(
            self.model_dir, self.config, self.config.workers, self.log_dir, self.admin_token, self.data_token,
            self.log, self.adapter,
        )

    async def _why_unusable(self, client: httpx.AsyncClient, url: str) -> str | None:
        """Why the server at `url`, started elsewhere, cannot join the fleet; None if it can.
        fleetrl signs its admin calls with the run's token and trusts what the server reports
        about its weights, so a server that would obey a caller without the admin token is
        refused, not merely warned about, and so is one that cannot prove it holds the token.
        Each answer must come whole within admin_timeout_s (the client bounds each read only: a
        server that trickles its answer would hold the run's start)."""
        timeout_s = self.config.admin_timeout_s

        async def answer(request: httpx.Request) -> httpx.Response:
            try:
                return await answered_within(timeout_s, client.send(request))
            except httpx.TimeoutException:
                raise FleetrlError(f"no whole answer from {request.url} within {timeout_s:g} s "
                                   "(inference.admin_timeout_s)") from None

        async def status(path: str, token: str | None = None) -> int:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return (await answer(client.build_request("GET", f"{url}{path}", headers=headers))).status_code

        try:
            if await status("/health") != 200:
                return f"cannot reach {url} (no answer on /health)"
            if await status(ADMIN_CHECK_PATH) not in REFUSED:
                return (f"worker {url} accepts admin calls without a token: start it with fleetrl's admin "
                        f"middleware (--middleware {ADMIN_MIDDLEWARE}, tokens in ${ADMIN_TOKEN_ENV} and "
                        f"${DATA_TOKEN_ENV})")
            instance, _ = await announced_instance(client, url, timeout_s)
            if instance is None:
                return (f"worker {url} names no instance at {INSTANCE_PATH}: start it with this fleetrl's admin "
                        f"middleware (--middleware {ADMIN_MIDDLEWARE})")
            request = client.build_request("GET", f"{url}{ADMIN_CHECK_PATH}")
            nonce = sign(request, self.admin_token, instance)
            signed = await answer(request)
            if signed.status_code in REFUSED:
                return (f"worker {url} refused the admin token: set inference.admin_token (or "
                        f"${ADMIN_TOKEN_ENV}) to the one it was started with")
            if why := unproven(signed, self.admin_token, nonce, instance):
                return f"worker {url}: {why}"
            if await status(DATA_CHECK_PATH, self.data_token) in REFUSED:
                return (f"worker {url} refused the data token: set inference.data_token (or "
                        f"${DATA_TOKEN_ENV}) to the one it was started with")
        except httpx.TransportError:
            return f"cannot reach {url} (no answer on /health)"
        except FleetrlError as e:  # no whole answer in time
            return str(e)
        return None

    def attach_settings(self) -> dict:
        """The inference settings with which another fleetrl attaches to these servers while
        they run (`fleetrl status RUN_DIR`): their URLs, and the tokens (secret fields)."""
        return {"provider": self.name, "urls": self.config.urls or [s.url for s in self.launched],
                "admin_token": self.admin_token, "data_token": self.data_token}

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

    def admin(self, worker: WorkerInfo) -> VllmWorkerControl:
        return self._clients_of(worker)[0]

    def weight_sync(self, worker: WorkerInfo) -> VllmWeightSync:
        return self._clients_of(worker)[1]

    def _clients_of(self, worker: WorkerInfo) -> tuple[VllmWorkerControl, VllmWeightSync]:
        if worker.id not in self._clients:
            routes = VllmAdminRoutes(worker.id, worker.admin_url, self.admin_token, self.config.admin_timeout_s,
                                     self.config.admin_retries, self._claim)
            self._clients[worker.id] = VllmWorkerControl(routes), VllmWeightSync(routes)
        return self._clients[worker.id]

    async def restart(self, worker: WorkerInfo) -> str | None:
        """Start a launched server again at its address, after stopping what is left of it (a
        hung one is killed); its id once it answers /health (a FleetrlError if it exits first
        or takes longer than startup_timeout_s). It serves nothing until the fleet has refitted it."""
        server = next((s for s in self.launched if s.name == worker.id), None)
        if server is None:
            return None  # attached: started elsewhere, restarted elsewhere
        # Off the event loop: a hung server's process group may take a moment to go.
        await asyncio.to_thread(server.process.stop, 0)
        port = int(server.url.rsplit(":", 1)[1])
        server.process = start_server(self.model_dir, self.config, server.name, server.index, port, self.log_dir,
                                      self.admin_token, self.data_token, self.adapter)
        await wait_healthy([server], self.config.startup_timeout_s, self.log)
        return worker.id

    async def close(self) -> None:
        for control, _ in self._clients.values():
            await control.close()  # and the weight-sync client's routes with it: they are one
        self._clients.clear()
        await self._data.close()
        stop_groups([server.process for server in self.launched])  # together: within one grace period


def _worker(worker_id: str, url: str) -> WorkerInfo:
    """A native server serves requests and its admin routes on one port."""
    return WorkerInfo(id=worker_id, data_url=url, admin_url=url)
