"""`[inference.vllm]`: the engine settings of every vLLM engine fleetrl launches, native servers and
Dynamo's workers alike, and the engine arguments that fleetrl sets itself or that would change
what a worker samples from, which `extra_args` may not set."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fleetrl.config.section import Section, check_cpu_lists
from fleetrl.contract import ENGINE_ARGS, TOKEN_VERSIONS_FLAG
from fleetrl.cores import parse_cpus


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
        description="Per launched worker (in launch order, cycled), the CPUs it runs on, as a CPU list (\"0\", "
        "\"2-3\"): its processes' CPU affinity, and one OpenMP thread per CPU for its engine. Empty: where the OS "
        "puts it, with one engine thread (vLLM's serving default). Filled by run.core_plan for two workers or more.",
    )

    @field_validator("omp_threads_bind")
    @classmethod
    def _cpu_lists(cls, value: list[str]) -> list[str]:
        return check_cpu_lists(value)

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

    def engine_cpus(self, index: int) -> list[int]:
        """The CPUs the `index`-th launched engine runs on; empty where none are set."""
        return parse_cpus(self.omp_threads_bind[index % len(self.omp_threads_bind)]) if self.omp_threads_bind else []

    def engine_env(self, index: int) -> dict[str, str]:
        """The environment of the `index`-th launched engine. Its model runs in the engine-core
        process: on a CPU vLLM would start a worker process for it, a third interpreter importing
        vLLM (seconds more to serve, docs/benchmarks.md), and bind that one itself, where fleetrl binds
        the whole server (`engine_cpus`). One OpenMP thread per CPU it is bound to. No torch.compile:
        past --enforce-eager, vLLM still compiles a helper of its sampler's logprobs with inductor
        at the first request and again at the next batch size, seconds of CPU per engine for a
        count that costs nothing eager (docs/benchmarks.md, "A launched server's start")."""
        cpus = self.engine_cpus(index)
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
                **({"OMP_NUM_THREADS": str(len(cpus))} if cpus else {})}
