"""Configuration: one pydantic model per section, loaded from TOML files and dotted CLI flags.

A config is assembled from, in order of increasing precedence:
  1. the defaults below,
  2. TOML files named with `@ file.toml` (several are merged left to right),
  3. dotted flags such as `--inference.workers 2`.
A section may hold subsections: `[inference.dynamo]` in TOML, `--inference.dynamo.worker` as
a flag; both name the same field, as do error messages, `--help` and docs/config.md.

Every section forbids unknown keys, and every error names the key and where it came from
(a file or the command line), so a misspelt key never silently falls back to a default.
"""

from __future__ import annotations

import ipaddress
import math
import tomllib
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleetrl.admin_signature import is_loopback
from fleetrl.contract import ENGINE_ARGS, TOKEN_VERSIONS_FLAG
from fleetrl.cores import parse_cpus
from fleetrl.errors import FleetrlError
from fleetrl.lora import LLAMA_LINEARS, VLLM_MAX_LORA_RANKS, AdapterSpec, vllm_max_lora_rank


# The longest any timeout or interval may be: a week. Longer is a hang by another name, and
# the timers under them overflow near 1e15 s (at the first publish, not at start).
MAX_WAIT_S = 7 * 24 * 3600.0

# A failed admin call is tried again after ADMIN_BACKOFF_S, then twice as long before each next
# try (inference/http.py), at most ADMIN_RETRIES_MAX times: a publish waits these out while it
# holds the fence, so neither the count nor their sum may grow without bound.
ADMIN_RETRIES_MAX = 5
ADMIN_BACKOFF_S = 0.5

# The share of inference.claim_lease_s the fleet counts on its claim of a worker after a renewal
# was sent: the rest is slack for the two machines' clocks and a request sent as the check passes.
CLAIM_TRUSTED_SHARE = 0.9


def admin_backoff_s(attempt: int) -> float:
    """The wait after failed try `attempt` (0: the first) of an admin call, before the next."""
    return ADMIN_BACKOFF_S * 2**attempt


class ConfigError(FleetrlError):
    """A configuration problem, phrased as one line naming the key and its source."""


class Section(BaseModel):
    # Numbers must be finite (TOML and the flags accept `nan` and `inf`): a NaN learning rate or
    # timeout would only show up as a broken run much later. The fields where `inf` means "off"
    # say so with `Field(allow_inf_nan=True)` and refuse NaN themselves (`_no_nan`).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def _no_nan(value: float) -> float:
    if math.isnan(value):
        raise ValueError("must be a number, not nan")
    return value


def loss_conflict(ratio_level: str, tis_level: str, tis_cap: float, prefix: str = "") -> str | None:
    """Why these policy-loss options do not combine, or None: the one statement of the rule, which
    the trainer's `LossConfig` (prefix "") and `TrainerConfig` (prefix "trainer.") both apply."""
    if tis_level == "sequence" and ratio_level == "sequence":
        return (f"{prefix}tis_level = 'sequence' does not combine with {prefix}ratio_level = 'sequence': GSPO's "
                "ratio is already the sample's importance weight (length-normalized); cap it with "
                f"{prefix}tis_level = 'token'")
    if tis_level == "sequence" and math.isinf(tis_cap):
        return (f"{prefix}tis_level = 'sequence' needs a finite {prefix}tis_cap: a sample's uncapped product of "
                "ratios overflows")
    return None


class ModelConfig(Section):
    path: Path | None = Field(
        None,
        description="Local Hugging Face model folder; unset = the embedded SmolLM2-135M-Instruct "
        "(materialized once into the fleetrl cache).",
    )
    cache_dir: Path | None = Field(
        None,
        description="Where the embedded model is materialized; unset = $FLEETRL_CACHE, else "
        "~/.cache/fleetrl.",
    )


PauseMode = Literal["keep", "abort", "wait"]


def pause_modes(token_versions: bool, disaggregated: bool, adapter_on_dynamo: bool = False) -> tuple[PauseMode, ...]:
    """The pause modes that keep the version of every token exact; the first is the default.

    The one statement of this rule: the config resolves and checks `inference.pause_mode` with
    it, and a Dynamo worker's admin client checks each pause against what the worker reports.
    Without per-token versions (Dynamo's own worker) only `wait` is exact: in `keep` mode a
    request held across an update would mix versions with no record of where, and in `abort`
    mode Dynamo reports the cut request as finish_reason "stop", so it could not be told from
    a finished one and continued. With prefill workers apart from decode workers, a request
    held or cut while its KV is between them would resume on KV of the old weights. A Dynamo
    worker serving a LoRA adapter refuses a keep pause while requests through it run.
    """
    if not token_versions or disaggregated:
        return ("wait",)
    return ("abort", "wait") if adapter_on_dynamo else ("keep", "abort", "wait")


# The arguments of a launched engine that fleetrl sets itself, which inference.vllm.extra_args
# may not set again (vLLM takes the last): a native server's (inference/vllm/launcher.server_argv),
# a Dynamo worker's (inference/dynamo/launcher.worker_argv), a LoRA run's (lora.AdapterSpec.
# engine_args, --lora-modules), and the Dynamo flags whose environment variables the Dynamo
# launcher sets (DYN_NAMESPACE, DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE, DYN_EVENT_PLANE). A
# second --port, --middleware or --served-model-name would leave fleetrl calling a server that
# is not where it looks, guarded by nothing, or serving under another name. `--config` reads
# any of them from a file.
LAUNCHER_OWNED_ARGS = (
    "--model", "--served-model-name", "--host", "--port", "--dtype", "--max-model-len", "--enforce-eager",
    "--enable-scale-out", "--middleware", "--uvicorn-log-level", *ENGINE_ARGS[::2],
    "--enable-lora", "--max-lora-rank", "--max-loras", "--max-cpu-loras", "--lora-target-modules", "--lora-modules",
    TOKEN_VERSIONS_FLAG, "--enable-rl", "--disaggregation-mode", "--kv-transfer-config",
    "--namespace", "--discovery-backend", "--request-plane", "--event-plane", "--config",
)
# The arguments of vLLM's that change what a worker samples from or reports without any of
# fleetrl's checks noticing: the weights it loads (--load-format dummy is random weights),
# their config or dtype, the tokenizer (whose end-of-sequence token ends a completion), the
# default sampling of every request, or what a logprob is. fleetrl labels what a launched
# worker loads v0, the trainer's own weights, and trains on the logprobs it reports.
WORKER_MODEL_ARGS = (
    "--load-format", "--hf-overrides", "--hf-config-path", "--revision", "--code-revision", "--quantization",
    "--quantization-config", "--tokenizer", "--tokenizer-revision", "--generation-config",
    "--override-generation-config", "--logprobs-mode",
)
WORKER_MODEL_SHORT_ARGS = {"-q": "--quantization"}  # vLLM's short spellings of WORKER_MODEL_ARGS


def owned_arg(arg: str, owned_args: tuple[str, ...] = LAUNCHER_OWNED_ARGS) -> str | None:
    """The argument of `owned_args` that `arg`, an element of an engine's command line, sets,
    as vLLM's parser reads it: `--x y` or `--x=y`, `_` for `-`, a key of a JSON argument
    (`--x.key`), the `--no-x` of a switch, or an abbreviation (argparse takes any unambiguous
    prefix, and no other argument of vLLM's or Dynamo's is a prefix of one of these); None if
    it sets none."""
    if not arg.startswith("--") or arg == "--":
        return None
    name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    if name.startswith("--no-"):
        name = f"--{name[5:]}"
    return next((owned for owned in owned_args if owned.startswith(name)), None)


class VllmConfig(Section):
    """Engine settings of every vLLM engine fleetrl launches: native servers and Dynamo's workers."""

    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32",
        description="Serving dtype; float32 on CPUs without native bf16 (about 5x faster there).",
    )
    max_model_len: int = Field(1024, ge=16, description="Longest prompt + completion, in tokens.")
    kv_cache_gib: int = Field(
        1, ge=1, description="KV-cache size per CPU worker, in GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra command-line arguments passed verbatim to every launched vLLM server "
        "(or Dynamo vLLM worker). Not the ones fleetrl sets itself: "
        + ", ".join(LAUNCHER_OWNED_ARGS) + " (in any spelling, `--x=y` included, or abbreviated). Nor those that "
        "change the weights the workers load, their dtype, tokenizer, default sampling or logprobs, which fleetrl "
        "labels v0 and trains on: " + ", ".join(WORKER_MODEL_ARGS) + ", -q. Not "
        "--api-server-count (-asc) other than 1: fleetrl's signed admin calls need one API server process.",
    )
    omp_threads_bind: list[str] = Field(
        default_factory=list,
        description="Per launched worker (in launch order, cycled), the CPUs its engine's threads are bound to, "
        "as a CPU list (\"0\", \"2-3\"): vLLM's VLLM_CPU_OMP_THREADS_BIND. Empty: vLLM's own choice (which "
        "puts every worker on the same first cores). Filled by run.core_plan for two workers or more.",
    )

    @field_validator("omp_threads_bind")
    @classmethod
    def _cpu_lists(cls, value: list[str]) -> list[str]:
        return _check_cpu_lists(value)

    @field_validator("extra_args")
    @classmethod
    def _one_api_server_process(cls, value: list[str]) -> list[str]:
        """Each API server process of a server would be an instance of its own, with its own memory
        of signed calls (engine/admin_auth.py): fleetrl's calls would be refused at random."""
        for i, arg in enumerate(value):
            name, inline, count = arg.partition("=")
            name = name.replace("_", "-")
            # vLLM's parser takes -asc, and any unambiguous abbreviation of the long name.
            if name == "-asc" or (len(name) > len("--api-s") and "--api-server-count".startswith(name)):
                count = count if inline else (value[i + 1] if i + 1 < len(value) else "")
                if count.strip() != "1":
                    setting = arg if inline else f"{arg} {count}"
                    raise ValueError(f"{setting!r} runs several API server processes per server, each taking "
                                     "signed admin calls for itself alone: fleetrl needs one (remove it)")
        return value

    @field_validator("extra_args")
    @classmethod
    def _not_what_fleetrl_sets(cls, value: list[str]) -> list[str]:
        for arg in value:
            if owned := owned_arg(arg):
                raise ValueError(f"{arg!r} sets {owned}, which fleetrl's launcher sets itself (the fleet relies on "
                                 "it); remove it")
            # A short option takes its value attached too (`-qfp8`).
            short = next((long for short, long in WORKER_MODEL_SHORT_ARGS.items() if arg.startswith(short)), None)
            if model := short or owned_arg(arg, WORKER_MODEL_ARGS):
                raise ValueError(f"{arg!r} sets {model}, which changes what the workers sample from or the "
                                 "logprobs they report, unseen by fleetrl, which labels their weights v0; remove it")
        return value

    def cpu_env(self, index: int) -> dict[str, str]:
        """The environment that binds the `index`-th launched engine to its CPUs, if any are set."""
        return {"VLLM_CPU_OMP_THREADS_BIND": self.omp_threads_bind[index % len(self.omp_threads_bind)]} \
            if self.omp_threads_bind else {}


class DynamoConfig(Section):
    """The Dynamo deployment fleetrl launches or attaches to (read with inference.provider = dynamo)."""

    worker: Literal["dynamo", "fleetrl"] = Field(
        "dynamo",
        description="Dynamo worker kind: dynamo (Dynamo's own vLLM worker: one exact version per "
        "completion, inference.pause_mode wait only) or fleetrl (the same worker reporting the "
        "version of every token: any pause mode). In attach mode, the kind the deployment runs.",
    )
    frontend_url: str | None = Field(
        None,
        description="Attach mode: base URL of a running frontend's OpenAI API; unset = fleetrl "
        "launches a frontend and `inference.workers` workers.",
    )
    rl_url: str | None = Field(
        None,
        description="Attach mode: base URL of that frontend's RL discovery (its DYN_RL_PORT; "
        "fleetrl reads GET /v1/rl/workers).",
    )
    namespace: str | None = Field(
        None, description="Dynamo namespace of the launched frontend and workers (DYN_NAMESPACE); unset = "
        "fleetrl-<the run's id (drawn at its first start, kept in its run directory)>, one per run, so that runs "
        "sharing an etcd never see each other's workers.",
    )
    components: list[str] = Field(
        default_factory=lambda: ["backend", "prefill"],
        description="Components whose RL workers the launched frontend lists (DYN_RL_COMPONENTS); "
        "dynamo.vllm registers aggregated and decode workers as `backend`, prefill workers as `prefill`.",
    )
    prefill_workers: int = Field(
        0, ge=0,
        description="Prefill workers launched beside `inference.workers` decode workers (disaggregated "
        "serving through the frontend's prefill router); 0 = `inference.workers` aggregated workers.",
    )
    kv_transfer_config: dict[str, Any] | None = Field(
        None,
        description="KV connector of launched prefill/decode workers (vLLM --kv-transfer-config, "
        "kv_role defaults to kv_both); unset = vLLM's shared-storage connector with its store in "
        "RUN_DIR/kv-store (one machine; what runs on a CPU). On GPUs e.g. {kv_connector = \"NixlConnector\"}.",
    )
    discovery: Literal["file", "etcd", "kubernetes"] = Field(
        "file",
        description="Discovery backend of launched Dynamo processes (DYN_DISCOVERY_BACKEND): file "
        "(a folder in the run dir; one machine), etcd (workers register under leases that expire "
        "when they die), or kubernetes.",
    )
    etcd_endpoints: list[str] = Field(
        default_factory=list,
        description="etcd endpoints for inference.dynamo.discovery = etcd (ETCD_ENDPOINTS); unset = "
        "fleetrl launches an etcd of its own on loopback (data in RUN_DIR/etcd) and stops it with "
        "the deployment.",
    )
    event_plane: Literal["zmq", "nats"] = Field(
        "zmq",
        description="Event plane of launched Dynamo processes (DYN_EVENT_PLANE: KV events, load "
        "metrics): zmq (peer to peer, no server) or nats (through a NATS server: NATS_SERVER in "
        "inference.dynamo.env, else fleetrl launches one on loopback). Only nats connects to NATS.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment for every launched Dynamo process (e.g. NATS_SERVER, "
        "POD_NAMESPACE); overrides fleetrl's own settings.",
    )
    allow_unauthenticated_admin: bool = Field(
        False,
        description="Let launched Dynamo workers bind their system port (the RL admin routes, which "
        "take no token) to inference.host when it is not loopback; protect the port with a network "
        "policy (docs/dynamo.md).",
    )

    @model_validator(mode="after")
    def _fields_fit(self) -> "DynamoConfig":
        if (self.frontend_url is None) != (self.rl_url is None):
            raise ValueError("inference.dynamo.frontend_url and inference.dynamo.rl_url: set both "
                             "(attach to a running Dynamo deployment) or neither (launch one)")
        if self.etcd_endpoints and self.discovery != "etcd":
            raise ValueError("inference.dynamo.etcd_endpoints is set but inference.dynamo.discovery is not 'etcd'")
        return self


class WeightsConfig(Section):
    """How each new policy version travels from the trainer to every worker."""

    transport: Literal["broadcast", "filesystem"] = Field(
        "broadcast",
        description="How weights reach workers: torch.distributed broadcast (gloo/NCCL) or "
        "safetensors shards on shared storage.",
    )
    bucket_mb: int = Field(
        128, ge=1, description="Broadcast bucket size, or filesystem shard size, in MiB."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="torch.distributed backend of the broadcast: auto = NCCL, GPU to GPU, when the "
        "weights sent are on CUDA (a CUDA trainer), gloo over TCP otherwise (a CPU trainer); gloo on a "
        "CUDA trainer stages each bucket through host memory (for workers NCCL cannot reach); nccl "
        "needs a CUDA device in the trainer.",
    )
    dir: Path | None = Field(
        None,
        description="Filesystem transport's storage, readable by every worker; unset = RUN_DIR/weights.",
    )
    sender_host: str = Field(
        "127.0.0.1", description="Address at which workers reach the trainer's broadcast group."
    )
    transfer_timeout_s: float = Field(
        600.0, gt=0, le=MAX_WAIT_S, description="Limit for each weight-transfer step on a worker (join, bucket, load)."
    )


class InferenceConfig(Section):
    provider: Literal["vllm", "dynamo"] = Field(
        "vllm", description="Inference provider: native vLLM servers or an NVIDIA Dynamo deployment."
    )
    workers: int = Field(1, ge=1, description="Number of inference workers fleetrl launches (decode "
                         "workers when inference.dynamo.prefill_workers > 0).")
    urls: list[str] = Field(
        default_factory=list,
        description="Attach to servers started elsewhere (base URLs) instead of launching; "
        "overrides `workers`. Each server once: two spellings of one (localhost and 127.0.0.1, a trailing "
        "slash, a default port written out) are refused.",
    )
    host: str = Field(
        "127.0.0.1",
        description="Address launched servers bind to; loopback unless you mean to expose "
        "the admin routes.",
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, le=MAX_WAIT_S, description="How long a launched worker may take to answer /health."
    )
    request_timeout_s: float = Field(
        300.0, gt=0, le=MAX_WAIT_S, description="Timeout of one generation request on the data plane."
    )
    admin_timeout_s: float = Field(
        60.0, gt=0, le=MAX_WAIT_S, description="Timeout of one admin call (pause, resume, version, weights)."
    )
    admin_retries: int = Field(
        2, ge=0, le=ADMIN_RETRIES_MAX,
        description=f"Retries of an admin call that failed to connect or timed out, at most {ADMIN_RETRIES_MAX}: "
        f"they wait {ADMIN_BACKOFF_S:g} s, then twice as long each time, "
        f"{sum(map(admin_backoff_s, range(ADMIN_RETRIES_MAX))):g} s in all at most, which a publish waits out "
        "holding its fence (besides each try's inference.admin_timeout_s).",
    )
    admin_token: str | None = Field(
        None,
        description="The token the admin routes (pause, weights, versions) require: native servers' and fleetrl's "
        "Dynamo worker kind's. fleetrl signs its calls with it and never sends it; an operator's curl may send it "
        "as a bearer token. Unset = $FLEETRL_ADMIN_TOKEN, else a fresh random token per run. Never written to "
        "config.toml.",
        json_schema_extra={"secret": True},
    )
    data_token: str | None = Field(
        None,
        description="Bearer token the data plane (sampling) requires; unset = $FLEETRL_DATA_TOKEN, "
        "else a fresh random token per run. Never written to config.toml.",
        json_schema_extra={"secret": True},
    )
    health_timeout_s: float = Field(
        10.0, gt=0, le=MAX_WAIT_S,
        description="Timeout of one health check: a worker that does not answer in time (hung, "
        "not dead) is taken out of routing and of the next publish fence.",
    )
    max_restarts: int = Field(
        3, ge=0,
        description="Restarts of launched workers that died or hung, over the whole run (a launched Dynamo "
        "worker is replaced by a new instance; a worker a discovery round misses but that still answers its "
        "health check is replaced only if the next round misses it too); a restarted worker is refitted and "
        "verified before it serves. A restart whose worker does not come up is given back.",
    )
    no_worker_timeout_s: float = Field(
        600.0, gt=0, le=MAX_WAIT_S,
        description="The run stops, naming each worker and its last error, when no worker has "
        "been ready for this long.",
    )
    probe_tolerance: float = Field(
        0.1, gt=0,
        description="Agreement probe after every publish: a worker whose prompt logprobs differ "
        "from the trainer's by more than this (max |delta|) is marked stale and refitted.",
    )
    pause_mode: PauseMode | None = Field(
        None,
        description="How a publish pauses workers: keep (in-flight requests continue on the new "
        "weights), abort (they are cut and continued), wait (drained first); unset = keep, or wait "
        "with inference.dynamo.worker = dynamo (no per-token versions) or "
        "inference.dynamo.prefill_workers > 0, or abort for fleetrl's Dynamo worker kind serving a LoRA "
        "adapter (trainer.lora), which refuses keep.",
    )
    discovery_interval_s: float = Field(
        5.0, gt=0, le=MAX_WAIT_S, description="How often the fleet re-discovers workers and checks their health."
    )
    claim_lease_s: float = Field(
        30.0, gt=0, le=MAX_WAIT_S,
        description="Workers (native vLLM servers and Dynamo workers alike) are held by one run at a time: each "
        "admin call of the run renews its claim for this long, and another run that reaches the worker meanwhile "
        "(attached to the same URL or Dynamo frontend) is refused, naming this one. A run that stops lets its "
        "workers go at once; one killed holds them this "
        "long, except from a resume of its own run directory. The run renews it every discovery_interval_s with a "
        "health check (even while discovery's listing fails) and routes nothing to a worker once "
        f"{CLAIM_TRUSTED_SHARE:g} of the lease has passed since its last renewal was sent, until the worker has "
        "been renewed and verified again: so at least (discovery_interval_s + 2 * health_timeout_s) / "
        f"{CLAIM_TRUSTED_SHARE:g} (a check is sent at most one interval and one timeout after the last, and "
        "answers within another timeout).",
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    dynamo: DynamoConfig = Field(default_factory=DynamoConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)

    @field_validator("urls")
    @classmethod
    def _one_entry_per_server(cls, urls: list[str]) -> list[str]:
        # Two entries of one server would be two workers: the first publish pauses it twice, and fails.
        seen: dict[tuple[str, str, int | None, str], str] = {}
        for url in urls:
            if (server := server_address(url)) in seen:
                raise ValueError(f"{seen[server]!r} and {url!r} name one server (the same scheme, host and port: "
                                 "every loopback name is one host); list each server once")
            seen[server] = url
        return urls

    @model_validator(mode="after")
    def _dynamo_fields_need_dynamo(self) -> "InferenceConfig":
        if self.provider == "dynamo":
            if self.urls:
                raise ValueError("inference.urls is set but inference.provider is 'dynamo': to attach to a "
                                 "Dynamo deployment set inference.dynamo.frontend_url and inference.dynamo.rl_url")
            return self
        if self.dynamo.frontend_url:
            raise ValueError("inference.dynamo.frontend_url is set but inference.provider is not 'dynamo'")
        if self.dynamo.prefill_workers:
            raise ValueError("inference.dynamo.prefill_workers is set but inference.provider is not 'dynamo'")
        return self

    @model_validator(mode="after")
    def _claim_outlasts_its_renewals(self) -> "InferenceConfig":
        renewal_s = self.discovery_interval_s + 2 * self.health_timeout_s
        if self.claim_trusted_s() < renewal_s:
            raise ValueError(f"inference.claim_lease_s ({self.claim_lease_s:g}) must be at least "
                             f"{renewal_s / CLAIM_TRUSTED_SHARE:g}: (inference.discovery_interval_s "
                             f"({self.discovery_interval_s:g}) + 2 * inference.health_timeout_s "
                             f"({self.health_timeout_s:g})) / {CLAIM_TRUSTED_SHARE:g}, or the run's workers would "
                             "leave its routing between the health checks that renew its claim on them")
        return self

    @model_validator(mode="after")
    def _pause_mode_fits_workers(self) -> "InferenceConfig":
        if self.pause_mode is None or self.pause_mode in self._pause_modes():
            return self
        if not self.token_versions():
            raise ValueError(f"inference.pause_mode {self.pause_mode!r} needs per-token versions, which "
                             "Dynamo's own worker does not report: set inference.dynamo.worker = 'fleetrl' "
                             "or inference.pause_mode = 'wait'")
        raise ValueError("inference.dynamo.prefill_workers needs inference.pause_mode = 'wait' (a request "
                         "held or cut while its KV is between prefill and decode would resume on KV of "
                         "the old weights)")

    def resolved_pause_mode(self) -> PauseMode:
        return self.pause_mode or self._pause_modes()[0]

    def attaches(self) -> bool:
        """Whether the fleet attaches to workers someone else started (inference.urls, or a Dynamo
        deployment's frontend_url) rather than launching its own: every trainer rank then takes
        part in handing the fleet the base weights (trainer/loop.py)."""
        return bool(self.dynamo.frontend_url) if self.provider == "dynamo" else bool(self.urls)

    def token_versions(self) -> bool:
        return self.provider == "vllm" or self.dynamo.worker == "fleetrl"

    def claim_trusted_s(self) -> float:
        """How long after a renewal of its claim on a worker was sent the run counts on it (Fleet)."""
        return self.claim_lease_s * CLAIM_TRUSTED_SHARE

    def admin_call_bound_s(self) -> float:
        """The longest one admin call takes: every try to its timeout, and the waits between them."""
        return self.admin_timeout_s * (self.admin_retries + 1) + sum(map(admin_backoff_s, range(self.admin_retries)))

    def _pause_modes(self) -> tuple[PauseMode, ...]:
        return pause_modes(self.token_versions(), disaggregated=self.dynamo.prefill_workers > 0)


def check_env_spec(spec: str) -> str:
    """An environment is named by a module's import path, never a file's: `pkg/tasks.py:Env`
    would fail later as an unknown module, or as an environment name with a `/`."""
    module = spec.partition(":")[0]
    if "/" in module or "\\" in module or module.endswith(".py"):
        dotted = module.removesuffix(".py").replace("\\", "/").strip("/").replace("/", ".")
        raise ValueError(f"{spec!r} names a file; name the environment by its import path, module.path:Attr "
                         f"({dotted}:{spec.partition(':')[2] or 'Attr'}), from the folder that holds the package")
    return spec


class EnvEntry(Section):
    """One environment of a run that trains on several (`[[orchestrator.envs]]`)."""

    name: str = Field(min_length=1, pattern=r"^[^/]+$", description="How the run reports it: per-environment "
                      "figures in metrics.jsonl, the `env` of each record and sample, task ids `name/<id>`. Unique, "
                      "without a `/`.")
    env: str = Field("", description="The environment, as orchestrator.env names one (a built-in name, "
                     "verifiers:<env id>, module.path:Attr, or a registered name); empty = `name`.")
    options: dict[str, Any] = Field(default_factory=dict, description="Its keyword options, as "
                                    "orchestrator.env_options.")
    weight: float = Field(1.0, gt=0, description="Its share of the prompts: each prompt's environment is "
                          "drawn by weight (seeded).")

    @field_validator("env")
    @classmethod
    def _env_is_no_file_path(cls, spec: str) -> str:
        return check_env_spec(spec)

    @property
    def env_id(self) -> str:
        return self.env or self.name


def _check_unique_names(entries: list[EnvEntry], key: str) -> None:
    """Each environment's name is how the run reports it: two of one name would be merged."""
    names = [entry.name for entry in entries]
    if dupes := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"{key}: the name {dupes[0]!r} is given to two environments")


class OrchestratorConfig(Section):
    max_off_policy_steps: int = Field(
        1,
        ge=0,
        description="k: the largest off-policy distance a trained sample may have; 0 = strictly "
        "on-policy.",
    )
    env: str = Field(
        "reverse_text",
        description="Environment: a built-in task (reverse_text, arithmetic, dataset: a data file's rows; multi-turn: "
        "arithmetic_retry, and calculator, with a tool), verifiers:<env id>, module.path:Attr (a class or factory, "
        "imported with the current directory on sys.path), or a name an installed package registers (entry points "
        "`fleetrl.environments`). docs/environments.md.",
    )
    env_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword options of the environment: its class's or factory's keyword arguments (e.g. "
        "{max_len = 5} for reverse_text; {config = {...}} for a verifiers taskset).",
    )
    envs: list[EnvEntry] = Field(
        default_factory=list,
        description="Several environments in one run, instead of env and env_options: a list of tables (TOML: "
        "[[orchestrator.envs]] entries), each with `name` (unique: how the run reports it), `env` (as "
        "orchestrator.env names one; empty = the name), `options` and `weight` (> 0, default 1). Each prompt's environment is "
        "drawn by weight; each environment's reward and counts are reported apart (metrics.jsonl `envs`, "
        "TensorBoard `env/<name>/...`).")
    batch_prompts: int = Field(8, ge=1, description="Prompts per batch (one group of samples each).")
    group_size: int = Field(
        4, ge=1,
        description="Samples per prompt (at least 2); GRPO normalizes rewards within a group.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="Drop a group whose rewards are all equal (its advantages are all 0: it carries no gradient) "
        "and sample more prompts until the batch has batch_prompts groups, within dynamic_sampling_prompts. "
        "Pick it when many groups are all right or all wrong (binary rewards, a task too hard or too easy), "
        "where the batch's gradient would come from a few groups. What was filtered is in metrics.jsonl "
        "(filtered, sampled_prompts).")
    dynamic_sampling_prompts: int = Field(
        0, ge=0,
        description="With dynamic_sampling: the most prompts one batch samples, first batch_prompts, then as many "
        "as groups are missing; a batch still short at the bound trains on the groups it has. 0 = 3 x "
        "batch_prompts. Each step takes its prompts from a window of this many tasks of the seeded stream (the "
        "unused ones skipped), so a resume draws what an uninterrupted run would.")
    normalize_advantages_std: bool = Field(
        True, description="Divide group-centered rewards by the group's std (GRPO); false = Dr. GRPO."
    )
    max_tokens: int = Field(32, ge=1, description="Most completion tokens per sample.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    reward_timeout_s: float = Field(
        30.0, gt=0, le=MAX_WAIT_S,
        description="Longest a reward function may take for one sample, and a multi-turn environment its answer "
        "to one turn; a reward that raises, hangs or returns a non-number drops its sample, which is counted "
        "(reward_failed; env_failed for an answer).",
    )
    task_timeout_s: float = Field(
        300.0, gt=0, le=MAX_WAIT_S,
        description="Longest an environment's task stream may take to give one step's tasks, and the chat "
        "template to render one prompt; past it the run ends, naming the environment (both run off the loop "
        "that drives the fleet, which a hung one would otherwise stop).",
    )
    max_turns: int = Field(
        4, ge=1,
        description="Most model turns of one episode of a multi-turn environment (each up to max_tokens); "
        "single-turn environments take one.",
    )
    partial_episodes: bool = Field(
        False,
        description="A multi-turn episode whose tokens fall more than k versions behind is continued on the "
        "current weights, and trained on its tokens within k (the older ones stay in as context), instead of "
        "being stopped and dropped.",
    )

    @field_validator("env")
    @classmethod
    def _env_is_no_file_path(cls, spec: str) -> str:
        return check_env_spec(spec)

    @model_validator(mode="after")
    def _one_way_to_name_the_environments(self) -> "OrchestratorConfig":
        # By value, not by what was set: config.toml, which a resume reads, writes every field.
        if self.envs and (self.env != OrchestratorConfig.model_fields["env"].default or self.env_options):
            raise ValueError("orchestrator.env / env_options and orchestrator.envs are both set: name one "
                             "environment with the first, or several with the second")
        _check_unique_names(self.envs, "orchestrator.envs")
        return self

    def env_entries(self) -> list[EnvEntry]:
        """The run's environments: `envs`, or the one `env` names."""
        return self.envs or [EnvEntry(name=self.env, options=self.env_options)]

    @model_validator(mode="after")
    def _dynamic_sampling_bound_holds_a_batch(self) -> "OrchestratorConfig":
        if self.dynamic_sampling_prompts and self.dynamic_sampling_prompts < self.batch_prompts:
            raise ValueError(f"orchestrator.dynamic_sampling_prompts ({self.dynamic_sampling_prompts}) must be at "
                             f"least orchestrator.batch_prompts ({self.batch_prompts}), or 0 (3 x batch_prompts)")
        return self

    def prompts_per_step(self) -> int:
        """The tasks of the seeded stream each step takes its prompts from: step n's window starts
        at task (n - 1) x this (tests/integration/test_conformance.py reads it so too)."""
        if not self.dynamic_sampling:
            return self.batch_prompts
        return self.dynamic_sampling_prompts or 3 * self.batch_prompts

    @field_validator("group_size")
    @classmethod
    def _groups_have_a_baseline(cls, value: int) -> int:
        if value < 2:
            # The group-relative advantage of a sample alone in its group is always 0.
            raise ValueError("must be at least 2: GRPO's advantage is relative to the group, so every "
                             "sample of a 1-sample group has advantage 0 and nothing is learned")
        return value


class LoraConfig(Section):
    """LoRA: train low-rank adapters on the base model's linear layers instead of all its weights
    (peft); only the adapter is trained, checkpointed and published. Off while rank = 0. Served by
    the workers fleetrl launches (native vLLM, or Dynamo without prefill workers); refused with
    inference.urls, inference.dynamo.frontend_url and inference.dynamo.prefill_workers > 0."""

    rank: int = Field(
        0, ge=0,
        description=f"The adapter's rank r; 0 = off (full fine-tuning). At most {VLLM_MAX_LORA_RANKS[-1]}: workers "
        "serve it with the smallest vLLM --max-lora-rank at least r "
        f"(one of {', '.join(map(str, VLLM_MAX_LORA_RANKS))}).",
    )
    alpha: float = Field(16.0, gt=0, description="LoRA's alpha: the update B A is scaled by alpha / rank (alpha / "
                         "sqrt(rank) with use_rslora).")
    dropout: float = Field(
        0.0, ge=0, lt=1,
        description="Dropout on the adapter's input while training. Keep 0: the importance ratio compares the "
        "trainer's logprob of each token with the sampler's, and a forward with dropout scores the same token at "
        "random, which the ratio, the clip and the mismatch figures would take for a policy change.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LLAMA_LINEARS),
        description="The linear layers that get an adapter, by name within a decoder layer. Not embed_tokens nor "
        "lm_head: SmolLM2 ties them, and workers refit the tied head from the embedding.",
    )
    use_rslora: bool = Field(False, description="Rank-stabilized LoRA: scale by alpha / sqrt(rank) instead of "
                             "alpha / rank, so a larger rank does not shrink the update.")

    @field_validator("rank")
    @classmethod
    def _vllm_serves_the_rank(cls, value: int) -> int:
        if value:
            vllm_max_lora_rank(value)  # its ValueError says why
        return value

    @field_validator("target_modules")
    @classmethod
    def _linears_only(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("names no layer: list the linear layers that get an adapter")
        tied = [name for name in value if name in ("embed_tokens", "lm_head")]
        if tied:
            raise ValueError(f"{tied[0]} cannot take an adapter: the embedding and the head are tied (one tensor), "
                             "and workers refit the head from the embedding; adapt the linear layers only")
        unknown = [name for name in value if name not in LLAMA_LINEARS]
        if unknown:  # peft would adapt the names it finds and drop the rest without a word
            raise ValueError(f"{unknown[0]} is no linear layer of a decoder layer: name some of "
                             f"{', '.join(LLAMA_LINEARS)}")
        if len(set(value)) != len(value):
            raise ValueError("names a layer twice")
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def spec(self) -> AdapterSpec | None:
        """The adapter these settings make; None while LoRA is off."""
        if not self.enabled:
            return None
        return AdapterSpec(rank=self.rank, alpha=self.alpha, target_modules=tuple(self.target_modules),
                           use_rslora=self.use_rslora, dropout=self.dropout)


class TrainerConfig(Section):
    """The trainer's ranks, optimizer and policy loss (the loss options' math: src/fleetrl/trainer/loss.py)."""

    world_size: int = Field(1, ge=1, description="Number of trainer ranks (torch.distributed) that `fleetrl rl` "
                            "starts on this machine. Under torchrun, WORLD_SIZE: leave it unset (docs/cluster.md).")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate: the peak of the schedule (lr_warmup_steps, "
                      "lr_decay); the rate of each step is in metrics.jsonl (`lr`).")
    lr_warmup_steps: int = Field(
        0, ge=0, description="Steps 1..N climb linearly to `lr`: the first batches' advantages are the noisiest and "
        "Adam's moments are not settled yet. 0 = none.")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After warmup: constant keeps `lr`; linear and cosine decay it from `lr` toward "
        "`lr_min` over `lr_decay_steps` (each step at the rate as it begins: the last still learns), then hold "
        "`lr_min`. Cosine stays near the peak longer and eases into the end.")
    lr_decay_steps: int = Field(
        0, ge=0, description="Steps the decay runs over after warmup; 0 = until run.max_steps (a resume that raises "
        "max_steps then stretches the rest of the decay: set this to keep it fixed).")
    lr_min: float = Field(0.0, ge=0, description="Where linear or cosine decay ends; at most `lr`.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(
        1.0, gt=0, description="The global gradient norm is clipped to this before each optimizer step."
    )
    micro_batch_tokens: int = Field(
        4096, ge=1,
        description="Rows x padded length of one forward/backward, a row holding a group's prompt once and its "
        "completions: bounds activation memory.",
    )
    clip_low: float = Field(
        0.2, ge=0, le=1, description="PPO clip floor of the trainer/inference ratio, 1 - clip_low; 1 = off."
    )
    clip_high: float = Field(0.28, ge=0, allow_inf_nan=True,
                             description="PPO clip ceiling of the ratio, 1 + clip_high; inf = off.")
    tis_cap: float = Field(
        2.0, gt=0, allow_inf_nan=True,
        description="Truncated importance sampling: the most weight a token's ratio may carry; inf = off.",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="The ratio the PPO clip and the TIS cap act on: token = each token's own pi/mu; sequence = "
        "GSPO, the sample's exp(mean log pi/mu) on each of its tokens, so a sample is clipped or kept whole. Pick "
        "sequence for MoE models (routing noise in the token ratios averages out) or long sequences, with a far "
        "narrower clip (GSPO's: clip_low = 3e-4, clip_high = 4e-4).",
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token",
        description="What tis_cap caps: token = each token's ratio; sequence = the sample's product of ratios, "
        "the whole sequence's importance weight, which then weighs each of its tokens (needs a finite tis_cap; not "
        "with ratio_level = sequence). Pick sequence for long multi-turn samples, where the mismatch compounds "
        "from turn to turn; the product varies more the longer the sample, so the cap does more.",
    )
    mis_low: float = Field(
        0.0, ge=0, lt=1,
        description="Masked importance sampling (MIS): the floor of the band of the ratio pi/mu outside which "
        "mis_level drops tokens (they give no loss and no gradient, but still count in the divisor); in [0, 1), "
        "0 = off. metrics: masked_frac.",
    )
    mis_high: float = Field(
        math.inf, gt=1, allow_inf_nan=True,
        description="The ceiling of the MIS band, above 1; inf = off. IcePop is token-level MIS with the band [0.5, 5] "
        "and neither clip nor cap: configs/icepop.toml.",
    )
    mis_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="What the MIS band drops: token = each token outside it; sequence = a whole sample with any "
        "token outside; geometric = a whole sample whose geometric-mean ratio exp(mean log pi/mu) is outside. "
        "Pick masking over the TIS cap when a few tokens are far off (MoE routing, a kernel bug), which a cap "
        "keeps at its weight: token for short samples, sequence for long multi-turn ones (one broken token "
        "spoils what follows it), geometric when lengths vary (any-token rejects long samples more often).",
    )
    kl_coef: float = Field(
        0.0, ge=0,
        description="Weight of a KL penalty to the base model (the policy as the run started, kept through "
        "resumes), per token the k3 estimate of KL(pi, base); 0 = off. Pick it when drift from the base must be "
        "bounded (a reward that can be gamed, abilities to keep). Costs one more fp32 copy of each rank's share "
        "of the parameters and a forward without gradient per step; metrics: ref_kl.",
    )
    checkpoint_interval: int = Field(10, ge=0, description="Save a checkpoint every N steps (0 = never).")
    cpu_cores: list[str] = Field(
        default_factory=list,
        description="Per trainer rank (cycled), the CPUs it runs on, as a CPU list (\"1\", \"2-3\"), with one torch "
        "thread per CPU. Empty: every CPU, the threads shared out among the ranks. Filled by run.core_plan = \"auto\".",
    )

    @field_validator("cpu_cores")
    @classmethod
    def _cpu_lists(cls, value: list[str]) -> list[str]:
        return _check_cpu_lists(value)

    @field_validator("clip_high", "tis_cap", "mis_high")
    @classmethod
    def _inf_is_off_but_nan_is_nothing(cls, value: float) -> float:
        return _no_nan(value)

    @model_validator(mode="after")
    def _lr_min_below_the_peak(self) -> "TrainerConfig":
        if self.lr_min > self.lr:
            raise ValueError(f"trainer.lr_min ({self.lr_min:g}) must be at most trainer.lr ({self.lr:g})")
        return self

    @model_validator(mode="after")
    def _loss_options_combine(self) -> "TrainerConfig":
        conflict = loss_conflict(self.ratio_level, self.tis_level, self.tis_cap, prefix="trainer.")
        if conflict:
            raise ValueError(conflict)
        return self

    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept; older ones are deleted.")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="A step whose loss or gradient norm is not finite is never applied: stop = the "
        "run ends with an error naming the step; skip = the step's update is skipped and counted "
        "(metrics: skipped), the version is still published.",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)


class RunConfig(Section):
    dir: Path = Field(Path("runs/latest"), description="Run directory: config, logs, metrics.")
    max_steps: int = Field(10, ge=1, description="Trainer steps (= policy versions) to run.")
    seed: int = Field(0, description="Seed for sampling and training.")
    core_plan: Literal["workers", "auto", "off"] = Field(
        "workers", description="workers: when `fleetrl rl` launches two inference workers or more, each gets CPUs "
        "of its own where inference.vllm.omp_threads_bind is empty (vLLM's own choice puts them all on the same "
        "first cores); one worker keeps vLLM's choice, and the trainer ranks go where the OS puts them. auto: "
        "the launched workers and the trainer ranks all get CPUs of their own, where trainer.cpu_cores is empty "
        "too (not under torchrun). off: vLLM and the OS place everything. The plan is printed at the start.")
    live_view: Literal["auto", "off"] = Field(
        "auto", description="auto: on a terminal, `fleetrl rl` shows a live view (steps with ETA, rollouts, the "
        "trainer's phase, the workers) and progress bars; off: plain lines only, as when output is not a terminal.")
    tensorboard: bool = Field(True, description="Write each step's metrics as TensorBoard event files in "
                              "RUN_DIR/tensorboard (offline; `tensorboard --logdir RUN_DIR/tensorboard`).")
    wandb: bool = Field(False, description="Also log each step's metrics to Weights & Biases (needs the `wandb` "
                        "extra; files in RUN_DIR/wandb).")
    wandb_project: str = Field("fleetrl", min_length=1, description="The W&B project of the run (run.wandb).")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="W&B offline (files only: `wandb sync RUN_DIR/wandb/offline-run-*` uploads them) "
        "or online (needs WANDB_API_KEY in the environment, never in a config).")


class EvalConfig(Section):
    every_steps: int = Field(
        0, ge=0,
        description="Evaluate the policy on held-out prompts every N steps and at the last step, and the version "
        "the run starts from before its first publish; 0 = never. The trainer waits while it runs, so every "
        "evaluated token is of the one version (records in RUN_DIR/eval/, which `fleetrl verify` checks).")
    envs: list[EnvEntry] = Field(
        default_factory=list,
        description="What to evaluate on, as orchestrator.envs entries (their `env` any form orchestrator.env "
        "takes, module.path:Attr included); empty = the run's own environments, on "
        "their held-out split (the built-in ones keep one in ten tasks out of training). A named environment "
        "without a held-out split is evaluated on its tasks: name one training does not use.")
    prompts: int = Field(32, ge=1, description="Prompts per environment, the same ones at every evaluation.")
    samples_per_prompt: int = Field(1, ge=1, description="Completions per prompt: pass@1 and pass@k for k = this.")
    greedy: bool = Field(True, description="Greedy decoding (temperature 0); false = sampling at temperature 1, "
                         "as training does (needed for samples_per_prompt > 1).")
    pass_reward: float = Field(1.0, gt=0, le=1, description="A completion passes (pass@k) when its reward is at "
                               "least this.")

    @model_validator(mode="after")
    def _samples_differ(self) -> "EvalConfig":
        if self.greedy and self.samples_per_prompt > 1:
            raise ValueError(f"eval.samples_per_prompt = {self.samples_per_prompt} needs eval.greedy = false: "
                             "greedy completions of one prompt are all the same")
        _check_unique_names(self.envs, "eval.envs")
        return self


class SftConfig(Section):
    """`fleetrl sft`: supervised training on conversations, the loss on the assistant's tokens
    (the model, the optimizer, the steps and the run directory are trainer.*, model.* and run.*)."""

    path: Path | None = Field(
        None, description="The training data: a local .jsonl, .json, .parquet or .csv file, or a folder that "
        "`datasets` saved (save_to_disk). Each row is a conversation (sft.messages_field) or a prompt/completion "
        "pair (sft.prompt_field and sft.completion_field), whichever columns the table has.")
    split: str | None = Field(None, description="The split to read from a saved DatasetDict folder; unset = its "
                              "'train' split, else its only split.")
    messages_field: str = Field(
        "messages", min_length=1, description="The column of conversations: lists of {role, content} messages; "
        "every assistant message is trained on (its tokens and its end-of-turn token), the rest is context.")
    prompt_field: str = Field(
        "prompt", min_length=1, description="Without a messages column: the prompt's column, a string (rendered "
        "as one user message) or a list of messages, followed by the completion as the assistant's turn.")
    completion_field: str = Field("completion", min_length=1,
                                  description="Without a messages column: the completion's column, a string.")
    sequences_per_step: int = Field(
        32, ge=1, description="Rows per optimizer step, drawn in a seeded order (run.seed) that is reshuffled each "
        "pass over the data; run.max_steps x this / the rows = the epochs. The loss is the mean NLL over the "
        "step's assistant tokens.")
    max_tokens: int = Field(
        1024, ge=2, description="The longest row, rendered in the chat template, in tokens: a longer one is "
        "refused at the start (naming its file and row), never truncated. At most trainer.micro_batch_tokens.")


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _completions_fit_the_engine(self) -> "Config":
        # Here only what needs no tokenizer: with the prompts too, `fleetrl rl` checks
        # max_tokens + the longest prompt before it starts anything (app.rl.check_prompts_fit).
        if self.orchestrator.max_tokens >= self.inference.vllm.max_model_len:
            raise ValueError(f"orchestrator.max_tokens = {self.orchestrator.max_tokens} leaves no room for a "
                             f"prompt in inference.vllm.max_model_len = {self.inference.vllm.max_model_len}")
        return self

    @model_validator(mode="after")
    def _pause_mode_fits_a_dynamo_adapter(self) -> "Config":
        inference = self.inference
        if not (self.trainer.lora.enabled and inference.provider == "dynamo"):
            return self
        modes = pause_modes(inference.token_versions(), inference.dynamo.prefill_workers > 0, adapter_on_dynamo=True)
        if inference.pause_mode is None:
            inference.pause_mode = modes[0]
        elif inference.pause_mode not in modes:
            raise ValueError(f"inference.pause_mode {inference.pause_mode!r} with trainer.lora on Dynamo: Dynamo's "
                             "worker refuses a keep pause while requests through the adapter run; set "
                             "inference.pause_mode = 'abort' or 'wait'")
        return self

    @model_validator(mode="after")
    def _lr_decays_over_some_steps(self) -> "Config":
        t = self.trainer
        if t.lr_warmup_steps > self.run.max_steps and not t.lr_decay_steps:
            raise ValueError(f"trainer.lr_warmup_steps = {t.lr_warmup_steps} is longer than run.max_steps = "
                             f"{self.run.max_steps}: the rate would never reach trainer.lr")
        if t.lr_decay != "constant" and not t.lr_decay_steps and t.lr_warmup_steps >= self.run.max_steps:
            raise ValueError(f"trainer.lr_decay = {t.lr_decay} has no step to decay over: trainer.lr_warmup_steps = "
                             f"{t.lr_warmup_steps} takes all of run.max_steps = {self.run.max_steps} (or set "
                             "trainer.lr_decay_steps)")
        return self


def _check_cpu_lists(value: list[str]) -> list[str]:
    for spec in value:
        parse_cpus(spec)  # its ValueError names the list
    return value


DEFAULT_PORTS = {"http": 80, "https": 443}


def server_address(url: str) -> tuple[str, str, int | None, str]:
    """The server a base URL reaches, known without the network: its scheme (http where none is
    written), host, port (the scheme's default where none is written) and path without a trailing
    slash. Host names are compared lower-case, addresses as addresses, and every loopback name and
    address (localhost, 127.0.0.0/8, ::1) is one host: a server bound to localhost or to every
    address answers on each."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{url!r} is not a URL: {e}") from None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").rstrip(".")
    if is_loopback(host):
        host = "localhost"
    else:
        try:
            host = ipaddress.ip_address(host).compressed
        except ValueError:
            pass  # a host name
    return scheme, host, port or DEFAULT_PORTS.get(scheme), parts.path.rstrip("/")


def field_docs() -> list[tuple[str, str, Any]]:
    """(dotted name, description, default) of every leaf field, for --help and docs.

    The dotted name is also the field's flag and its TOML place: `inference.dynamo.worker` is
    `--inference.dynamo.worker`, or `worker` in the `[inference.dynamo]` table.
    """
    return _leaf_docs(Config, "")


def _leaf_docs(model: type[Section], prefix: str) -> list[tuple[str, str, Any]]:
    rows = []
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            rows += _leaf_docs(field.annotation, f"{prefix}{name}.")
        else:
            default = field.default_factory() if field.default_factory else field.default
            rows.append((f"{prefix}{name}", field.description or "", default))
    return rows


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Section)


def parse_override(text: str, path: tuple[str, ...] = ()) -> Any:
    """A CLI value as TOML (numbers, booleans, lists, quoted strings), else as a bare string.

    A field that only holds text (a token, a name, a path) takes the text as it is: a token
    of digits, such as `--inference.admin_token 0123`, stays the string "0123".
    """
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if not isinstance(value, str) and _holds_only_text(path):
        return text
    return value


def _holds_only_text(path: tuple[str, ...]) -> bool:
    model: Any = Config
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return False
        model = field.annotation
    kinds = [a for a in (get_args(model) if get_origin(model) in (Union, UnionType) else (model,))
             if a is not type(None)]
    return bool(kinds) and all(k in (str, Path) or get_origin(k) is Literal and all(
        isinstance(v, str) for v in get_args(k)) for k in kinds)


def load_config(files: list[Path], overrides: list[tuple[str, str]]) -> Config:
    """Merge TOML files and dotted overrides onto the defaults and validate the result."""
    merged: dict[str, Any] = {}
    source: dict[tuple[str, ...], str] = {}  # key path -> where it was set, for error messages

    for file in files:
        try:
            data = tomllib.loads(Path(file).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {file}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{file}: invalid TOML: {e}") from None
        _merge(merged, data, (), source, str(file))

    for dotted, value in overrides:
        path = tuple(dotted.split("."))
        nested: Any = parse_override(value, path)
        for part in reversed(path):
            nested = {part: nested}
        _merge(merged, nested, (), source, f"--{dotted}")

    try:
        return Config.model_validate(merged)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        origin = _origin(loc, source)
        key = ".".join(loc)
        if err["type"] == "extra_forbidden":
            raise ConfigError(f"unknown config key '{key}' (from {origin})") from None
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error" and not _is_leaf(loc):
            # A rule across fields (a section's or the whole config's): its message names them.
            raise ConfigError(f"{message} (from {origin})" if loc else message) from None
        raise ConfigError(f"config key '{key}': {message} (from {origin})") from None


def _is_leaf(loc: tuple[str, ...]) -> bool:
    """Whether `loc` names one field (not a section, nor the whole config)."""
    model: Any = Config
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return True  # inside a dict or list value: a field's content
        model = field.annotation
    return bool(loc) and not _is_section(model)


def _merge(into: dict, data: dict, prefix: tuple[str, ...], source: dict, origin: str) -> None:
    for key, value in data.items():
        path = prefix + (key,)
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, path, source, origin)
        else:
            into[key] = value
        source[path] = origin


def _origin(loc: tuple[str, ...], source: dict) -> str:
    # The longest prefix of the failing location that some file or flag set.
    for n in range(len(loc), 0, -1):
        if loc[:n] in source:
            return source[loc[:n]]
    return "defaults"


def to_toml(config: Config) -> str:
    """The resolved config as TOML, loadable again with `@ file`: one table per section.
    Secrets (tokens) are left out: this text goes to config.toml and to --dry-run's output.
    Written by tomli_w, which quotes what a hand-made writer got wrong (a newline in a string
    was written raw, and config.toml could not be read back: no resume, no verify). The text
    is read back before it is returned, so a config that TOML would not give back as it is
    fails here, before a run starts, not when it resumes."""
    text = tomli_w.dumps({name: _table(getattr(config, name)) for name in Config.model_fields})
    read_back = Config.model_validate(tomllib.loads(text))
    expected = without_secrets(config)
    if read_back != expected:
        key = next(f"{name}.{field}" for name in Config.model_fields
                   for field, value in getattr(expected, name).model_dump().items()
                   if getattr(getattr(read_back, name), field) != getattr(getattr(expected, name), field))
        raise ConfigError(f"config key '{key}': its value does not read back from TOML as it was set")
    return text


def without_secrets(config: Config) -> Config:
    """`config` as config.toml holds it: every secret field unset."""
    updates = {}
    for name in Config.model_fields:
        section = getattr(config, name)
        updates[name] = section.model_copy(update=dict.fromkeys(secret_fields(type(section))))
    return config.model_copy(update=updates)


def secret_fields(section: type[Section]) -> set[str]:
    """A section's fields that hold secrets (tokens): never written to disk or printed."""
    return {name for name, field in section.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("secret")}


def _table(section: Section) -> dict[str, Any]:
    """A section's values as TOML takes them: TOML has no null, so an unset value is left out."""
    values = section.model_dump(mode="json", exclude=secret_fields(type(section)))
    table = {key: value for key, value in values.items() if value is not None}
    for key, field in type(section).model_fields.items():
        if _is_section(field.annotation):
            table[key] = _table(getattr(section, key))
    return table
