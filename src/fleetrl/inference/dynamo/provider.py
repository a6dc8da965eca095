"""The Dynamo provider: a frontend that routes, and workers that Dynamo discovers. fleetrl launches
the deployment (launcher.py) or attaches to a running one, learns the workers from the
frontend's RL discovery (discovery.py), sends rollouts through the frontend pinned to the worker
the coordinator chose (data.py), and drives each worker's RL routes directly: its control client
(admin.py) and its weight-sync client (weight_sync.py), which share one fence record. How LoRA
workers are admitted, how claims hold a worker for one run, and which version guarantee each
worker kind gives: docs/dynamo.md."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from fleetrl.config import InferenceConfig
from fleetrl.contract import ADMIN_TOKEN_ENV
from fleetrl.errors import FleetrlError
from fleetrl.inference.answers import vocab_size
from fleetrl.inference.dynamo.admin import DynamoAdminRoutes, DynamoWorkerControl
from fleetrl.inference.dynamo.attribution import FenceRecord, prefill_agrees
from fleetrl.inference.dynamo.data import DynamoDataClient, gather_samples, served_model
from fleetrl.inference.dynamo.discovery import list_rl_workers
from fleetrl.inference.dynamo.launcher import SMOKE_PROMPT, DynamoDeployment, launch_dynamo, run_namespace
from fleetrl.inference.dynamo.weight_sync import DynamoWeightSync
from fleetrl.inference.dynamo.worker_kinds import DYNAMOS_OWN
from fleetrl.inference.http import SERVED_MODEL_NAME, wait_until_ready
from fleetrl.inference.types import GenerateRequest, GenerateResponse, SamplingParams, WorkerInfo
from fleetrl.lora import ADAPTER_NAME, AdapterSpec
from fleetrl.processes import ManagedProcess
from fleetrl.rundir import DeploymentPaths

# A completion is attributable unless a whole pause-resume happened while it was in flight
# (on its worker, or on its prefill worker); this many of those in a row means the fleet
# publishes faster than it samples.
ATTEMPTS = 3
# How often a request refused by a pause looks whether its worker has resumed.
PAUSE_POLL_S = 0.05
# One token through the adapter: a worker that serves it is admitted (DynamoProvider._serves_adapter).
ADAPTER_SMOKE = GenerateRequest(SMOKE_PROMPT, SamplingParams(max_tokens=1, logprobs=False))


class DynamoProvider:
    name = "dynamo"

    def __init__(self, config: InferenceConfig, model_dir: Path, run_dir: Path, run: str | None, log=print,
                 adapter: AdapterSpec | None = None) -> None:
        """`run`: the run whose versions label the workers, and which holds them (its run
        directory's `RunDir.run_id`); None: a provider that only looks at the workers (`fleetrl
        status`): it reads any run's versions and labels nothing. `adapter`: the LoRA adapter its
        launched workers serve every request through (a LoRA run's)."""
        if config.dynamo.namespace is None and run is not None:  # the run's own (launcher.run_namespace)
            config = config.model_copy(update={"dynamo": config.dynamo.model_copy(
                update={"namespace": run_namespace(run)})})
        self.config = config
        self.model_dir = model_dir
        self.run_dir = run_dir
        self.run = run  # the run whose versions label the workers
        # fleetrl's worker kind takes only calls signed with the admin token; Dynamo's own, none.
        signed_admin = config.worker_kind().signed_admin
        self.admin_token = config.admin_token if signed_admin else None
        if signed_admin and not self.admin_token:
            raise FleetrlError("inference.dynamo.worker = 'fleetrl' takes only admin calls signed with the run's admin "
                               f"token: set inference.admin_token or ${ADMIN_TOKEN_ENV}")
        self.log = log
        self.deployment: DynamoDeployment | None = None  # None when attached
        self.launches_workers = not config.attaches()
        # Attached: known now, so `fleetrl status` can discover without start(); launched: set by start().
        self._frontend_url, self._rl_url = config.dynamo.frontend_url, config.dynamo.rl_url
        self._data: DynamoDataClient | None = None  # set by start()
        self._discovery = httpx.AsyncClient(timeout=10.0)
        # Each worker's control and weight-sync clients, over one DynamoAdminRoutes: one fence record.
        self._clients: dict[str, tuple[DynamoWorkerControl, DynamoWeightSync]] = {}
        self._refused: set[str] = set()  # admin URLs of instances a launched deployment did not launch
        # Routes no worker needs any more, closed at the next discovery round (`_retire`).
        self._replaced: list[DynamoAdminRoutes] = []
        self._missing: set[str] = set()  # workers with an admin client whom the last round did not list
        self.adapter = adapter
        # Instance id -> the launched process discovery saw serving it (the one a restart replaces).
        self._launched_as: dict[str, ManagedProcess] = {}
        self._adapter_served: set[str] = set()  # workers found serving the adapter (`_serves_adapter`)
        self._adapter_waiting: set[str] = set()  # workers said not to serve the adapter yet (said once)

    async def start(self) -> None:
        if self._frontend_url:
            model_name = await served_model(self._discovery, self._frontend_url)
            self.log(f"fleetrl: attached to the Dynamo frontend at {self._frontend_url} serving {model_name!r} "
                     f"(RL discovery {self._rl_url})")
        else:
            self.deployment = await launch_dynamo(self.model_dir, self.config, self.config.workers, self.run_dir,
                                                  self.log, self.adapter)
            self._frontend_url, self._rl_url = self.deployment.frontend_url, self.deployment.rl_url
            model_name = ADAPTER_NAME if self.adapter else SERVED_MODEL_NAME
        self._data = DynamoDataClient(self._frontend_url, model_name, self.config.request_timeout_s, self.run,
                                      vocab_size=vocab_size(self.model_dir) if self.model_dir is not None else None)
        if self.adapter is not None and self.deployment is not None:
            await self._wait_serving_the_adapter(self.deployment)

    async def _wait_serving_the_adapter(self, deployment: DynamoDeployment) -> None:
        """Until every launched worker serves the adapter (`_serves_adapter`): the frontend takes
        the adapter's model card a moment after /engine/load_lora, and the fleet's first discovery
        must find the workers it starts with."""
        count = len(deployment.workers)

        async def not_serving() -> tuple[int, str] | None:
            served = len(await self.discover())
            return None if served >= count else (served, f"{served}/{count} worker(s) serve the LoRA adapter")

        await wait_until_ready("the LoRA adapter on the Dynamo workers", count, deployment.processes(), not_serving,
                               self.config.startup_timeout_s, self.log)

    def attach_settings(self) -> dict:
        """The inference settings with which another fleetrl attaches to this deployment while it
        runs (`fleetrl status RUN_DIR`): the frontend, its RL discovery, the worker kind, and for
        fleetrl's kind the admin token (a secret field: the run writes it apart)."""
        dynamo = {"frontend_url": self._frontend_url, "rl_url": self._rl_url, "worker": self.config.dynamo.worker}
        return {"provider": self.name, "dynamo": dynamo, **({"admin_token": self.admin_token} if self.admin_token else {})}

    async def discover(self) -> list[WorkerInfo]:
        """The deployment's workers. A launched deployment's are only those it launched: an
        instance someone else started in its namespace is refused (once, in one line) before the
        fleet sees it, so it is never paused, sent weights or routed to."""
        if self._rl_url is None:
            raise FleetrlError("the Dynamo provider was used before start()")
        workers = await list_rl_workers(self._discovery, self._rl_url, self._frontend_url,
                                        self.config.admin_timeout_s)
        if self.deployment is not None:
            launched = {w.id: p for w in workers if (p := self.deployment.live_worker_at(w.admin_url)) is not None}
            self._launched_as.update(launched)
            ours = [w for w in workers if w.id in launched]
            for worker in workers:
                if worker not in ours and worker.admin_url not in self._refused:
                    self._refused.add(worker.admin_url)
                    self.log(f"fleetrl: Dynamo worker {worker.id} at {worker.admin_url} refused: this run did not "
                             f"launch it (another deployment in namespace {self.config.dynamo.namespace}?)")
            workers = ours
            if self.adapter is not None:
                workers = [w for w in workers if await self._serves_adapter(w)]
        await self._retire({w.id for w in workers})
        return workers

    async def _serves_adapter(self, worker: WorkerInfo) -> bool:
        """Whether a launched worker serves the run's adapter: it was told its folder, and a
        request through the adapter's name, pinned to it, was served. One that does not yet is
        left out of this discovery round, with one line. (No prefill workers: app/checks.py.)"""
        if worker.id in self._adapter_served:
            return True
        process = self._launched_as.get(worker.id)
        if process is None:
            return False
        try:
            # Bounded: this runs inside a discovery round, which must go on for the other workers.
            async with asyncio.timeout(self.config.admin_timeout_s):
                await self.admin(worker).load_adapter(ADAPTER_NAME, DeploymentPaths(self.run_dir).adapter(process.name))
                # Its versions unread: the kind that asks the engine for none.
                await self._started_data().complete(worker.id, None, ADAPTER_SMOKE, [], 0, DYNAMOS_OWN)
        except (FleetrlError, TimeoutError) as e:
            if worker.id not in self._adapter_waiting:
                self._adapter_waiting.add(worker.id)
                why = str(e) or f"no answer within {self.config.admin_timeout_s:g} s"
                self.log(f"fleetrl: Dynamo worker {worker.id} does not serve the LoRA adapter yet ({why}); "
                         "admitted once it does")
            return False
        self._adapter_served.add(worker.id)
        return True

    async def _retire(self, listed: set[str]) -> None:
        """Close the admin clients no worker needs any more, so that their connections do not
        pile up over a long run: those replaced by a client for their worker's new URL, and those
        of workers missing from two discovery rounds in a row (a restarted Dynamo worker is a new
        instance, with a new id). Two rounds, not one: the fleet marks a worker a round does not
        list dead only once it holds the publish fence, and a publish under way until then still
        calls its client (one made again would not have its fence record)."""
        gone = [self._clients.pop(worker_id)[0].routes for worker_id in self._missing - listed
                if worker_id in self._clients]
        self._missing = self._clients.keys() - listed
        replaced, self._replaced = self._replaced, []
        for routes in [*replaced, *gone]:
            await routes.close()

    async def generate(self, worker: WorkerInfo, request: GenerateRequest, prompt_suffix: list[int] = (),
                       prefill: WorkerInfo | None = None) -> list[GenerateResponse]:
        admin = self.admin(worker)
        kind = await admin.worker_kind()
        for _ in range(ATTEMPTS):
            fences_at_dispatch = self._fences()
            at_dispatch = admin.routes.fence
            if not kind.dispatchable(at_dispatch):
                raise FleetrlError(f"worker {worker.id}: request {request.request_id} sent to a worker that is "
                                   f"paused or was never given a version ({worker.admin_url})")
            try:
                responses = await gather_samples(self._started_data(), worker.id, prefill.id if prefill else None,
                                                 request, list(prompt_suffix), kind)
            except FleetrlError:
                if not await self._resumed_after_refusing(admin.routes, at_dispatch):
                    raise
                self.log(f"fleetrl: worker {worker.id}: request {request.request_id} reached it paused for a publish "
                         "(Dynamo refuses a request through an adapter there); sent again now it has resumed")
                continue
            attributed = kind.attributed(responses, at_dispatch, admin.routes.fence)
            if attributed is None:
                self.log(f"fleetrl: worker {worker.id}: request {request.request_id} straddled a publish; "
                         "sampling it again")
                continue
            responses = attributed
            fences_at_receipt = self._fences()
            if all(prefill_agrees(r, fences_at_dispatch, fences_at_receipt) for r in responses):
                return responses
            self.log(f"fleetrl: request {request.request_id}: its prefill worker's version is not provably the "
                     "completion's; sampling it again")
        raise FleetrlError(f"worker {worker.id}: request {request.request_id} could not be attributed to one "
                           f"version in {ATTEMPTS} tries (publishes in a row, or a prefill worker fleetrl has "
                           "not refitted)")

    async def _resumed_after_refusing(self, routes: DynamoAdminRoutes, at_dispatch: FenceRecord) -> bool:
        """Whether a request that failed may have been refused by a pause, and the worker has
        resumed since: then it is sent again, whole. With an adapter, Dynamo's worker refuses a
        request that arrives while it is paused (where vLLM would hold it until the resume): one
        sent just before a publish paused its worker. Such a request was never admitted, so it
        produced no token. Waits for the resume at most request_timeout_s."""
        if self.adapter is None or routes.fence.pauses == at_dispatch.pauses:
            return False
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        while routes.fence.paused:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(PAUSE_POLL_S)
        return True

    async def prompt_logprobs(self, worker: WorkerInfo, token_ids: list[int],
                              prefill: WorkerInfo | None = None) -> list[float]:
        # A frontend with prefill workers refuses a pinned request without its prefill pin.
        return await self._started_data().prompt_logprobs(worker.id, token_ids, prefill.id if prefill else None)

    async def restart(self, worker: WorkerInfo) -> str | None:
        """Replace the launched worker behind a dead or hung instance with a new process, and
        return the id of the new instance it registers as, once the frontend lists it; the
        coordinator refits it before it serves, and the old one leaves discovery (or stays dead
        in it). None for an attached deployment, or when no process of this run serves the
        instance; a FleetrlError when the replacement exits first, or is not listed within
        startup_timeout_s."""
        if self.deployment is None:
            return None
        # The process discovery saw serving the instance (every worker the fleet knows came through
        # `discover`), not one looked up now: a process just killed may still be exiting, neither
        # listening nor exited yet.
        process = self._launched_as.get(worker.id)
        if process is None or process not in self.deployment.workers:
            self.log(f"fleetrl: Dynamo worker {worker.id} not restarted: no worker process this run launched "
                     f"serves it ({worker.admin_url})")
            return None
        # Off the event loop: a hung worker's process group may take a moment to go.
        replacement = await asyncio.to_thread(self.deployment.replace_worker, process)
        self.log(f"fleetrl: Dynamo worker {worker.id} ({process.name}) replaced by {replacement.name}")
        return await self._registered(self.deployment, replacement)

    async def _registered(self, deployment: DynamoDeployment, process: ManagedProcess) -> str:
        """The instance id a launched worker process registers as, once the frontend lists it
        (the instance whose system server it listens on)."""
        registered: list[str] = []

        async def unlisted() -> tuple[int, str] | None:
            try:
                listed = await list_rl_workers(self._discovery, self._rl_url, self._frontend_url,
                                               self.config.admin_timeout_s)
            except FleetrlError as e:
                return 0, str(e)
            registered[:] = [w.id for w in listed if deployment.live_worker_at(w.admin_url) is process]
            return None if registered else (0, "not listed by the frontend yet")

        await wait_until_ready(f"Dynamo worker {process.name}", 1, [process], unlisted, self.config.startup_timeout_s,
                               self.log)
        return registered[0]

    def admin(self, worker: WorkerInfo) -> DynamoWorkerControl:
        return self._clients_of(worker)[0]

    def weight_sync(self, worker: WorkerInfo) -> DynamoWeightSync:
        return self._clients_of(worker)[1]

    def _clients_of(self, worker: WorkerInfo) -> tuple[DynamoWorkerControl, DynamoWeightSync]:
        known = self._clients.get(worker.id)
        if known is None or known[0].routes.admin_url != worker.admin_url:
            if known is not None:
                self._replaced.append(known[0].routes)  # closed at the next round: a call may still be under way on it
            routes = DynamoAdminRoutes(worker.id, worker.admin_url, worker.world_size, self.config.admin_timeout_s,
                                       self.config.admin_retries, self.run, self.admin_token,
                                       self.config.claim_lease_s)
            self._clients[worker.id] = DynamoWorkerControl(routes), DynamoWeightSync(routes)
        return self._clients[worker.id]

    def _fences(self) -> dict[str, FenceRecord]:
        """Every worker's fence record now, by worker id."""
        return {worker_id: control.routes.fence for worker_id, (control, _) in self._clients.items()}

    async def close(self) -> None:
        if self.deployment is None:  # attached: another run may take the workers at once (launched ones stop below)
            await asyncio.gather(*(control.routes.release() for control, _ in self._clients.values()))
        for routes in [*(control.routes for control, _ in self._clients.values()), *self._replaced]:
            await routes.close()
        self._clients.clear()
        self._replaced.clear()
        if self._data:
            await self._data.close()
        await self._discovery.aclose()
        if self.deployment:
            self.deployment.stop()

    def _started_data(self) -> DynamoDataClient:
        if self._data is None:
            raise FleetrlError("the Dynamo provider was used before start()")
        return self._data
