"""What `fleetrl rl` refuses before it starts anything or touches the run directory: the
checks its --dry-run runs too. Light imports only (no torch), so --dry-run stays fast."""

from __future__ import annotations

from itertools import islice

from fleetrl.config import Config, ConfigError, EnvEntry
from fleetrl.envs import EnvError, env_tools, get_environment
from fleetrl.envs.base import eval_stream
from fleetrl.envs.mix import RunEnv, run_task_stream
from fleetrl.orchestrator.chat import render_prompt
from fleetrl.rundir import RunDir
from fleetrl.torchrun import launched_rank

# A LoRA run's server must start with --enable-lora and an adapter folder that its engine side
# keeps current (fleetrl/lora.py); fleetrl writes that folder for the servers it launches.
LORA_ON_ATTACHED = ("trainer.lora with {attached}: a LoRA run launches its workers (each with the adapter folder it "
                    "keeps current); unset {attached} and set inference.workers")

# Measured with vLLM 0.32's CPU build: a Dynamo prefill worker serving LoRA requests through the
# shared-storage KV connector dies in its output handler (a negative connector prefix-cache
# count, ValueError in vllm/v1/metrics/loggers.py), and its decode worker with it.
LORA_ON_PREFILL = ("trainer.lora with inference.dynamo.prefill_workers: a prefill worker that serves a LoRA adapter "
                   "through vLLM's shared-storage KV connector dies on this vLLM build; set "
                   "inference.dynamo.prefill_workers = 0")


def check_config(config: Config) -> tuple[list[RunEnv], list[RunEnv]]:
    """What `fleetrl rl` (and its --dry-run) refuses in a config before anything starts; the
    environments to train on and to evaluate on (none without eval.every_steps), built to check
    them."""
    take_world_from_launcher(config)
    o = config.orchestrator
    # vLLM reports logprobs of the untempered distribution; the importance ratio is only
    # right if the samples came from that same distribution.
    if o.temperature != 1.0 or o.top_p != 1.0:
        raise ConfigError("fleetrl rl samples at orchestrator.temperature = 1 and orchestrator.top_p = 1 "
                          "(the trainer's importance ratio needs the distribution vLLM reports logprobs of)")
    if config.trainer.lora.enabled and config.inference.attaches():
        raise ConfigError(LORA_ON_ATTACHED.format(attached=config.inference.capabilities().attach_keys))
    if config.trainer.lora.enabled and config.inference.dynamo.prefill_workers:
        raise ConfigError(LORA_ON_PREFILL)
    run_dir = RunDir(config.run.dir)
    envs = run_environments(config, run_dir)
    if not config.eval.every_steps:
        if config.eval.envs:  # named, so meant: a bad entry is refused now, not once evaluation is turned on
            eval_environments(config, run_dir, envs, "eval.envs")
        return envs, []
    return envs, eval_environments(config, run_dir, envs, f"eval.every_steps = {config.eval.every_steps}")


def eval_environments(config: Config, run_dir: RunDir, run_envs: list[RunEnv] | None, context: str) -> list[RunEnv]:
    """What `[eval]` scores (`fleetrl rl` during training, `fleetrl eval` once): the environments
    eval.envs names, else the run's own (`run_envs`, built here when None) on their held-out
    split. One without a held-out split is a ConfigError that starts with `context`."""
    if config.eval.envs:
        evaluated = make_environments(config.eval.envs, run_dir, "eval.envs")
    else:
        evaluated = run_environments(config, run_dir) if run_envs is None else run_envs
    for run_env in evaluated:
        try:
            next(eval_stream(run_env.env, config.run.seed, held_out_only=not config.eval.envs), None)
        except EnvError as e:
            raise ConfigError(f"{context}: {e}") from None
    return evaluated


def take_world_from_launcher(config: Config) -> None:
    """Under torchrun the trainer's ranks are the ones torchrun started: trainer.world_size
    becomes WORLD_SIZE, and a config that sets another number is refused."""
    launched = launched_rank()
    if launched is None:
        return
    trainer = config.trainer
    if "world_size" in trainer.model_fields_set and trainer.world_size != launched.world_size:
        raise ConfigError(f"trainer.world_size = {trainer.world_size}, but torchrun started {launched.world_size} "
                          "ranks (WORLD_SIZE): leave trainer.world_size unset under torchrun")
    if config.run.core_plan == "auto":  # it plans the CPUs of one machine, and a launcher may span several
        raise ConfigError("run.core_plan = 'auto' plans one machine's CPUs: under torchrun set trainer.cpu_cores "
                          "(per rank of a node) instead")
    trainer.world_size = launched.world_size


def run_environments(config: Config, run_dir: RunDir) -> list[RunEnv]:
    """The environments the run trains on."""
    o = config.orchestrator
    return make_environments(o.env_entries(), run_dir, "orchestrator.envs" if o.envs else "orchestrator.env")


def make_environments(entries: list[EnvEntry], run_dir: RunDir, key: str) -> list[RunEnv]:
    """The environments `entries` name; a name or an option one does not know is a ConfigError
    naming `key` (and the entry, of several)."""
    out = []
    for index, entry in enumerate(entries):
        options = dict(entry.options)
        if entry.env_id.startswith("verifiers:"):
            # verifiers users see each rollout's policy provenance in the episodes file.
            options.setdefault("episodes_path", run_dir.verifiers_episodes_path)
            options.setdefault("run_id", run_dir.root.name)
        try:
            out.append(RunEnv(entry.name, get_environment(entry.env_id, **options), entry.weight))
        except EnvError as e:
            raise ConfigError(f"{key}[{index}]: {e}" if key.endswith("envs") else f"{key}: {e}") from None
    return out


# The most prompts rendered to check their length: a long run's later prompts are left to the
# engine, which refuses a request that does not fit (a few seconds of start-up at most here).
PROMPTS_CHECKED = 4096


def check_prompts_fit(config: Config, envs: list[RunEnv], tokenizer) -> None:
    """The prompts the run will draw (the first PROMPTS_CHECKED), each plus
    orchestrator.max_tokens, fit the engine's max_model_len; otherwise vLLM would refuse
    their requests in the middle of the run."""
    o, limit = config.orchestrator, config.inference.vllm.max_model_len
    drawn = islice(run_task_stream(envs, config.run.seed),
                   min(config.run.max_steps * o.prompts_per_step(), PROMPTS_CHECKED))
    schemas = {run_env.name: [tool.schema() for tool in env_tools(run_env.env)] for run_env in envs}
    longest = max((len(render_prompt(tokenizer, d.task.messages, schemas[d.env.name])), d.id) for d in drawn)
    if longest[0] + o.max_tokens > limit:
        raise ConfigError(f"orchestrator.max_tokens = {o.max_tokens} + the longest prompt of the run "
                          f"({longest[0]} tokens, task {longest[1]}) > inference.vllm.max_model_len = {limit}")
