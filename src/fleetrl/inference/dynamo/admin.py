"""The RL routes of one Dynamo vLLM worker, `POST <system URL>/engine/<route>`, and its control
client: health, pause, resume, versions, what its ranks hold. Its weight-sync client
(weight_sync.py) shares the routes and the worker's fence record (attribution.py), from which
the provider derives the version of each completion of Dynamo's own worker kind. The routes,
their answers and why fleetrl's worker entry answers the checksum method with every rank's own
checksum: docs/dynamo.md, "Discovery, data plane, admin plane" and "Version guarantees"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fleetrl.config import pause_modes
from fleetrl.contract import (DYNAMO_CLAIM_FIELD, DYNAMO_CLAIM_RELEASE_ROUTE, DYNAMO_WORKER_MODULE, WEIGHT_STATE_METHOD,
                              RankWeights)
from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo.attribution import FenceRecord
from fleetrl.inference.dynamo.worker_kinds import DynamoWorkerKind, kind_reporting
from fleetrl.inference.http import ABANDON_TIMEOUT_S, AdminHttp, check_rank_checksums, requests_in_engine
from fleetrl.inference.provider import PauseMode, WorkerCallError, WorkerHeldByAnotherRun
from fleetrl.versions import incomplete_label, parse_label, version_label

# What Dynamo's weight-update route answers on a worker that is not paused.
NOT_PAUSED = "must be paused"


class DynamoAdminRoutes:
    """One worker's system port (one connection pool), shared by its control and weight-sync
    clients, with the run they act for and the fence record they both move."""

    def __init__(self, worker_id: str, system_url: str, world_size: int, timeout_s: float, retries: int,
                 run: str | None, admin_token: str | None = None, claim_lease_s: float | None = None) -> None:
        """`run`: the run whose versions these clients label the worker with; None for clients
        that only look (`fleetrl status`), which read any run's version and label nothing.
        `admin_token`: fleetrl's worker kind takes only calls signed with it (in the body,
        engine/dynamo_worker.py), and proves each answer; None for Dynamo's own kind.
        `claim_lease_s`: with a `run`, each call holds the worker for it this long past the call
        (engine/worker_claim.py; inference.claim_lease_s), and a worker another run holds
        refuses it (WorkerHeldByAnotherRun)."""
        self.worker_id = worker_id
        self.run = run
        self.admin_url = system_url
        self.world_size = world_size
        self.fence = FenceRecord()
        self.http = AdminHttp(worker_id, system_url, timeout_s, retries, admin_token, body_signed=True)
        self._claim = {"run": run, "lease_s": claim_lease_s} if run is not None and claim_lease_s is not None else None

    async def close(self) -> None:
        await self.http.close()

    async def release(self) -> None:
        """Let the worker go, if this run holds it (best effort, one try: a dead worker holds nothing)."""
        if self._claim is None:
            return
        try:
            await self.http.probe("POST", f"/engine/{DYNAMO_CLAIM_RELEASE_ROUTE}", ABANDON_TIMEOUT_S, signed=True,
                                  json={DYNAMO_CLAIM_FIELD: {"run": self.run, "release": True}})
        except FleetrlError:
            pass

    def claimed(self, body: dict[str, Any]) -> dict[str, Any]:
        """`body` with this run's claim on the worker, where these clients act for a run."""
        return body if self._claim is None else {**body, DYNAMO_CLAIM_FIELD: self._claim}

    def check_not_held(self, answer: object, what: str) -> None:
        """Raises WorkerHeldByAnotherRun if `answer` is the worker's refusal of a call of this
        run because another run holds it (engine/dynamo_worker.held_for_one_run)."""
        if isinstance(answer, dict) and "held_by" in answer:
            raise WorkerHeldByAnotherRun(self.worker_id, what, str(answer["held_by"]),
                                         float(answer.get("lease_left_s") or 0.0))

    async def call(self, route: str, body: dict[str, Any] | None = None,
                   timeout_s: float | None = None, retry: bool = True) -> dict[str, Any]:
        what = f"{route} at {self.admin_url}"
        if body and "engine_rpc" in body:
            what = f"{route} ({body['engine_rpc']}) at {self.admin_url}"
        response = await self.http.call("POST", f"/engine/{route}", idempotent=retry, timeout_s=timeout_s,
                                         what=what, json=self.claimed(body or {}))
        result = response.json()
        self.check_not_held(result, what)
        if result.get("status") not in ("ok", "success"):  # load_lora answers "success"
            raise WorkerCallError(self.worker_id, what, str(result.get("message") or result)[:300])
        return result

    async def on_ranks(self, method: str, kwargs: dict[str, Any], timeout_s: float | None = None,
                       reads_only: bool = False) -> dict[str, Any]:
        """Run engine method `method` on every rank; the route's answer. The route refuses a
        worker that is not paused unless told the call changes nothing (`reads_only`: a check)."""
        body = {"engine_rpc": method, **kwargs, "reset_prefix_cache": False}
        if reads_only:
            body["allow_unpaused"] = True
        return await self.call("update_weights_from_distributed", body, timeout_s=timeout_s, retry=reads_only)

    def label(self, version: int, incomplete: bool = False) -> str:
        if self.run is None:
            raise WorkerCallError(self.worker_id, "label", "this admin client only looks; it labels nothing")
        return (incomplete_label if incomplete else version_label)(version, self.run)


class DynamoWorkerControl:
    def __init__(self, routes: DynamoAdminRoutes) -> None:
        self.worker_id = routes.worker_id
        self.routes = routes
        self._kind: DynamoWorkerKind | None = None  # unknown until get_weight_version answers

    async def close(self) -> None:
        await self.routes.close()

    @property
    def instance(self) -> str | None:
        return self.routes.http.instance

    async def health(self) -> bool:
        """The engine's event loop answers (a round trip into the engine core)."""
        response = await self.routes.http.probe("POST", "/engine/liveness_probe", timeout_s=10.0, signed=True,
                                                json=self.routes.claimed({}))
        if response is None or response.status_code != 200:
            return False
        answer = response.json()
        self.routes.check_not_held(answer, f"liveness_probe at {self.routes.admin_url}")
        return answer.get("alive") is True

    async def is_paused(self) -> bool:
        """Dynamo has no route that says so, but its weight-update route refuses a worker that
        is not paused: a read-only engine method sent through it (the ranks' broadcast group
        names) runs only on a paused worker."""
        try:
            await self.routes.call("update_weights_from_distributed",
                                   {"engine_rpc": "fleetrl_broadcast_group", "reset_prefix_cache": False})
        except WorkerCallError as e:
            if NOT_PAUSED in str(e):
                return False
            raise
        return True

    async def worker_kind(self) -> DynamoWorkerKind:
        """The worker's kind, as it reports it: fleetrl's (per-token versions with its tokens) or
        Dynamo's own (worker_kinds.py)."""
        if self._kind is None:
            await self.version()
        assert self._kind is not None
        return self._kind

    async def pause(self, mode: PauseMode) -> None:
        # The pause-mode rule, checked against what the worker itself reports: in attach mode
        # the config only says which kind the deployment runs. Disaggregation was checked
        # when the config was loaded.
        if mode not in pause_modes((await self.worker_kind()).token_versions, disaggregated=False):
            raise WorkerCallError(self.worker_id, f"pause ({mode})",
                                  "Dynamo's own vLLM worker reports no per-token versions; set "
                                  "inference.pause_mode = \"wait\" or run fleetrl's worker kind")
        self.routes.fence = self.routes.fence.pausing()
        # clear_cache: a prefix cache filled by old weights must not serve the new version.
        await self.routes.call("pause_generation", {"mode": mode, "clear_cache": True})

    async def resume(self) -> None:
        self.routes.fence = self.routes.fence.resuming()
        await self.routes.call("resume_generation")
        self.routes.fence = self.routes.fence.resumed()

    async def version(self) -> int | None:
        """The version the worker reports; None if it was never given a fleetrl version."""
        result = await self.routes.call("get_weight_version")
        self._kind = kind_reporting(bool(result.get("token_versions")))
        label = parse_label(str(result["version"])) if result.get("version_declared") else None
        if label is None or (self.routes.run is not None and label.run != self.routes.run):
            return None  # never given one, an incomplete transfer's, or another run's
        return label.version

    async def load_adapter(self, name: str, folder: Path) -> None:
        """Have the worker serve LoRA adapter `name` from `folder` (`/engine/load_lora`): it
        publishes a model card for the name, through which the frontend routes requests naming
        it here. Once per worker: vLLM reads the folder again after every weight update, and a
        publish rewrites it (engine/weight_receiver.py). A no-op on a worker that has it."""
        await self.routes.call("load_lora", {"lora_name": name, "source": {"uri": folder.resolve().as_uri()}})

    async def set_version(self, version: int) -> None:
        if not self.routes.fence.paused:
            # The data plane relies on versions changing only while the worker is paused.
            raise WorkerCallError(self.worker_id, "set_weight_version", "the worker is not paused")
        await self.routes.call("set_weight_version", {"weight_version": self.routes.label(version)})
        self.routes.fence = self.routes.fence.at_version(version)

    async def weight_state(self) -> list[RankWeights]:
        result = await self.routes.on_ranks(WEIGHT_STATE_METHOD, {}, reads_only=True)
        if not isinstance(result.get("results"), list):
            raise WorkerCallError(self.worker_id, "weight check",
                                  "the worker answered without its ranks' checksums, which proves nothing: run it "
                                  f"with `python -m {DYNAMO_WORKER_MODULE}` (docs/dynamo.md)")
        return [RankWeights.from_result(self.worker_id, r) for r in result["results"]]

    async def verify_weights(self, checksum: str | None) -> list[RankWeights]:
        ranks = await self.weight_state()
        check_rank_checksums(self.worker_id, ranks, checksum)
        return ranks

    async def in_flight(self) -> int | None:
        """From the vLLM gauges that Dynamo's worker serves on its system port."""
        response = await self.routes.http.call("GET", "/metrics", idempotent=True, signed=False)
        return requests_in_engine(response.text)
