"""The orchestrator and the evaluator of a config, on a fleet: what `fleetrl rl` samples and
scores with (training rollouts, evaluation during training) and what `fleetrl eval` scores a
saved model with (one evaluation), built alike for both."""

from __future__ import annotations

from fleetrl.config import Config
from fleetrl.envs.mix import RunEnv
from fleetrl.inference.fleet import Fleet
from fleetrl.orchestrator.evaluation import Evaluator
from fleetrl.orchestrator.rollouts import Orchestrator
from fleetrl.rundir import RunDir


def build_orchestrator(config: Config, fleet: Fleet, envs: list[RunEnv], tokenizer, run_dir: RunDir,
                       log=print) -> Orchestrator:
    """Samples and scores `envs` on `fleet` as `config.orchestrator` says; a multi-turn episode's
    turns must fit the engine's max_model_len."""
    return Orchestrator(fleet, envs, tokenizer, config.orchestrator, run_dir, config.run.seed,
                        max_context=config.inference.vllm.max_model_len, log=log)


def build_evaluator(config: Config, orchestrator: Orchestrator, envs: list[RunEnv], run_dir: RunDir,
                    log=print) -> Evaluator:
    """`config.eval` on `envs` (checks.eval_environments) through the orchestrator: the run's own
    environments on their held-out split, or all the tasks of those eval.envs names."""
    return Evaluator(orchestrator, envs, config.eval, config.run.seed, held_out_only=not config.eval.envs,
                     run_dir=run_dir, last_step=config.run.max_steps, log=log)
