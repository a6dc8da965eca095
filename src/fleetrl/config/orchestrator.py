"""`[orchestrator]`: the environments a run trains on (one, or several weighted `[[orchestrator.envs]]`
entries), the sampling of each batch (groups, dynamic sampling, tokens, temperature) and the
time limits of rewards, task streams and multi-turn episodes."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from fleetrl.config.section import MAX_WAIT_S, Section


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


def check_unique_names(entries: list[EnvEntry], key: str) -> None:
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
        "drawn by weight; each environment's reward and counts are reported apart (metrics.jsonl `batch.envs`, "
        "TensorBoard `batch/envs/<name>/...`).")
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
        "(batch.filtered, batch.sampled_prompts).")
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
        check_unique_names(self.envs, "orchestrator.envs")
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
