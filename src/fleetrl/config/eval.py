"""`[eval]`: evaluation of the policy on held-out prompts during a run and by `fleetrl eval`: how
often, on which environments, how many prompts and samples, greedy or sampled, what passes."""

from __future__ import annotations

from pydantic import Field, model_validator

from fleetrl.config.orchestrator import EnvEntry, check_unique_names
from fleetrl.config.section import Section


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
        check_unique_names(self.envs, "eval.envs")
        return self
