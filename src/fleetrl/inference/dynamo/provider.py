"""The Dynamo provider: a frontend that routes, and workers that Dynamo discovers.

fleetrl launches the deployment (launcher.py) or attaches to a running one
(`inference.dynamo_frontend_url` + `dynamo_rl_url`), learns the workers from the frontend's RL
discovery (discovery.py), sends rollouts through the frontend pinned to the worker the
coordinator chose (data.py), and drives each worker's admin routes directly (admin.py).

Versions: fleetrl's worker kind reports the version of every token, as a native vLLM server
does. Dynamo's own vLLM worker reports none, so each of its completions gets the one version
the fence record proves produced it (`sequence_version`), and a completion it cannot
attribute is sampled again rather than mis-versioned.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from fleetrl.config import InferenceConfig
from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo.admin import DynamoAdminClient, FenceRecord
from fleetrl.inference.dynamo.data import DynamoDataClient, gather_samples, sequence_version, served_model, with_span
from fleetrl.inference.dynamo.discovery import list_rl_workers
from fleetrl.inference.dynamo.launcher import SERVED_MODEL_NAME, DynamoDeployment, launch_dynamo
from fleetrl.inference.types import GenerateRequest, GenerateResponse, WorkerInfo

# A completion is attributable unless a whole pause-resume happened while it was in flight
# (on its worker, or on its prefill worker); this many of those in a row means the fleet
# publishes faster than it samples.
ATTEMPTS = 3


class DynamoProvider:
    name = "dynamo"

    def __init__(self, config: InferenceConfig, model_dir: Path, run_dir: Path, log=print) -> None:
        self.config = config
        self.model_dir = model_dir
        self.run_dir = run_dir
        self.log = log
        self.deployment: DynamoDeployment | None = None  # None when attached
        self._rl_url: str | None = None
        self._data: DynamoDataClient | None = None
        self._discovery = httpx.AsyncClient(timeout=10.0)
        self._admins: dict[str, DynamoAdminClient] = {}

    async def start(self) -> None:
        if self.config.dynamo_frontend_url:
            frontend_url, self._rl_url = self.config.dynamo_frontend_url, self.config.dynamo_rl_url
            model_name = await served_model(self._discovery, frontend_url)
            self.log(f"fleetrl: attached to the Dynamo frontend at {frontend_url} serving {model_name!r} "
                     f"(RL discovery {self._rl_url})")
        else:
            self.deployment = await launch_dynamo(self.model_dir, self.config, self.config.workers, self.run_dir,
                                                  self.log)
            frontend_url, self._rl_url = self.deployment.frontend_url, self.deployment.rl_url
            model_name = SERVED_MODEL_NAME
        self._data = DynamoDataClient(frontend_url, model_name, self.config.request_timeout_s)

    async def discover(self) -> list[WorkerInfo]:
        if self._rl_url is None:
            raise FleetrlError("the Dynamo provider was used before start()")
        return await list_rl_workers(self._discovery, self._rl_url)

    async def generate(self, worker: WorkerInfo, request: GenerateRequest, prompt_suffix: list[int] = (),
                       prefill: WorkerInfo | None = None) -> list[GenerateResponse]:
        admin = self.admin(worker)
        token_versions = await admin.reports_token_versions()
        for _ in range(ATTEMPTS):
            fences = {worker_id: a.fence for worker_id, a in self._admins.items()}
            at_dispatch = admin.fence
            if not token_versions and (at_dispatch.paused or at_dispatch.version is None):
                raise FleetrlError(f"worker {worker.id}: request {request.request_id} sent to a worker that is "
                                   f"paused or was never given a version ({worker.url})")
            responses = await gather_samples(self._started_data(), worker.id, prefill.id if prefill else None,
                                             request, list(prompt_suffix), token_versions)
            if not token_versions:
                version = sequence_version(at_dispatch, admin.fence)
                if version is None:
                    self.log(f"fleetrl: worker {worker.id}: request {request.request_id} straddled a publish; "
                             "sampling it again")
                    continue
                responses = [with_span(r, version) for r in responses]
            if all(self._prefill_agrees(r, fences) for r in responses):
                return responses
            self.log(f"fleetrl: request {request.request_id}: its prefill worker's version is not provably the "
                     "completion's; sampling it again")
        raise FleetrlError(f"worker {worker.id}: request {request.request_id} could not be attributed to one "
                           f"version in {ATTEMPTS} tries (publishes in a row, or a prefill worker fleetrl has "
                           "not refitted)")

    def _prefill_agrees(self, response: GenerateResponse, fences: dict[str, FenceRecord]) -> bool:
        """Disaggregated serving: the prompt's KV came from a prefill worker (the one the
        fleet pinned, which the data client checks), so that worker's version over the
        request (its fence record, as for any worker without per-token versions) must be
        the completion's version. A prefill worker fleetrl has not refitted yet has no
        version, so its work is never accepted."""
        prefill = response.prefill_worker_id
        if prefill is None:
            return True
        admin, at_dispatch = self._admins.get(prefill), fences.get(prefill)
        if admin is None or at_dispatch is None or at_dispatch.paused:
            return False  # unknown, or paused at dispatch: it may have prefilled after the publish
        version = sequence_version(at_dispatch, admin.fence)
        return version is not None and {span.version for span in response.spans} <= {version}

    async def prompt_logprobs(self, worker: WorkerInfo, token_ids: list[int],
                              prefill: WorkerInfo | None = None) -> list[float]:
        # A frontend with prefill workers refuses a pinned request without its prefill pin.
        return await self._started_data().prompt_logprobs(worker.id, token_ids, prefill.id if prefill else None)

    def admin(self, worker: WorkerInfo) -> DynamoAdminClient:
        known = self._admins.get(worker.id)
        if known is None or known.url != worker.url:
            self._admins[worker.id] = DynamoAdminClient(worker.id, worker.url, worker.world_size, self.config.admin_timeout_s,
                                                        self.config.admin_retries)
        return self._admins[worker.id]

    async def close(self) -> None:
        for admin in self._admins.values():
            await admin.close()
        self._admins.clear()
        if self._data:
            await self._data.close()
        await self._discovery.aclose()
        if self.deployment:
            self.deployment.stop()

    def _started_data(self) -> DynamoDataClient:
        if self._data is None:
            raise FleetrlError("the Dynamo provider was used before start()")
        return self._data
