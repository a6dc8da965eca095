"""Where each trainer step's line goes: one sink (`StepSink`) writes it, in this order, to
metrics.jsonl (the record `fleetrl verify` reads), TensorBoard event files in the run directory
(by default, offline), Weights & Biases when `run.wandb` is set (offline unless
`run.wandb_mode` says otherwise), the live view on a terminal, and the printed step line.

In TensorBoard and W&B every number of the line is charted at its step under its path in the
line, `/`-joined: `update/loss`, `batch/reward_mean`, `batch/envs/<name>/samples`,
`batch/workers/<id>/tokens_per_s`, `publish/worker_seconds/<id>`; an evaluation's under
`eval/<environment>/<name>`, at the evaluated version. metrics.jsonl stays the record; these are
views of it.
"""

from __future__ import annotations

import tomllib
from typing import Protocol

from fleetrl.config import Config, to_toml
from fleetrl.errors import FleetrlError
from fleetrl.records import EvalFigures, SftLine, StepLine
from fleetrl.rundir import RunDir

# Figures of a step line that are no measure to chart: wall-clock stamps and identities.
NOT_CHARTED = ("step", "version", "dispatch_version", "rollout_started", "rollout_finished", "train_started",
               "train_finished")


def scalars(line: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of one step line (as metrics.jsonl has it), by chart name: their path in it
    (a boolean as 0 or 1; None and text are left out)."""
    out = {}
    for key, value in line.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif key not in NOT_CHARTED and isinstance(value, int | float):
            out[f"{prefix}{key}"] = float(value)
    return out


class StepView(Protocol):
    """The live view, as the sink sees it (app/live.py)."""

    def step_done(self, step: int, detail: str) -> None: ...


def kl_text(kl: float | None) -> str:
    """A KL figure of the step line: `n/a` where no token measured it (mismatch_tokens = 0)."""
    return f"{kl:.1e}" if kl is not None else "n/a"


def dropped_text(line: StepLine) -> str:
    """Every sample not trained, by reason (off_policy, misversioned, bad_answer, reward_failed,
    empty, tool_failed, env_failed, filtered), or none."""
    return ", ".join(f"{reason} {count}" for reason, count in line.batch.dropped_by.items()) or "none"


def step_text(line: StepLine, max_steps: int, dynamic_sampling: bool) -> str:
    """The printed step line."""
    batch, update = line.batch, line.update
    loss = f"{update.loss:+.4f}" if update.loss is not None else "n/a"
    return (f"step {line.step}/{max_steps}  reward {batch.reward_mean:.3f}±{batch.reward_std:.3f}  "
            f"off-policy max {update.max_off_policy} mean {update.mean_off_policy:.2f}  dropped {dropped_text(line)}  "
            + (f"filtered {batch.filtered}/{batch.sampled_prompts} groups  " if dynamic_sampling else "")
            + f"loss {loss}  mismatch {kl_text(update.mismatch_kl)}  staleness {kl_text(update.staleness_kl)}  "
            f"lr {update.lr:.1e}  train {line.train_finished - line.train_started:.1f}s  "
            f"publish {line.publish.seconds:.1f}s  workers at {sorted(set(line.worker_versions.values()))}"
            + (f"  waves {waves_text(line)}" if line.publish.waves else ""))


def waves_text(line: StepLine) -> str:
    """The waves of rolling publishes that ended since the last step's: v<version>/<wave> (a
    canary starred), the workers it brought to the version and its seconds."""
    return ", ".join(f"v{w.version}/{w.wave}{'*' if w.canary else ''} {'+'.join(w.ready) or 'none'} {w.seconds:.1f}s"
                     for w in line.publish.waves or [])


def outlier_texts(line: StepLine) -> list[str]:
    """A line per worker whose mismatch_kl stands out from the others' (trainer/mismatch.py)."""
    kl = {worker: value for worker, value in line.update.worker_mismatch_kl.items() if value is not None}
    return [f"fleetrl: step {line.step}: worker {worker}'s mismatch_kl {kl[worker]:.2e} stands out from the other "
            f"workers' ({', '.join(f'{v:.1e}' for w, v in kl.items() if w != worker)}): its engine disagrees with "
            "the trainer at the same version" for worker in line.update.mismatch_outliers]


class StepSink:
    """Each step's line, to every place a user reads it; `close` flushes them all."""

    def __init__(self, config: Config, run_dir: RunDir, view: StepView | None = None, log=print) -> None:
        run = config.run
        self.run_dir = run_dir
        self.view = view
        self.log = log
        self.max_steps = run.max_steps
        self.dynamic_sampling = config.orchestrator.dynamic_sampling
        self._tensorboard = self._wandb = None
        if run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(run_dir.tensorboard_dir))
            log(f"fleetrl: TensorBoard event files in {run_dir.tensorboard_dir} "
                f"(tensorboard --logdir {run_dir.tensorboard_dir})")
        if run.wandb:
            try:
                import wandb
            except ImportError:
                raise FleetrlError("run.wandb = true but the wandb package is not installed "
                                   "(pip install -e '.[wandb]')") from None
            run_dir.wandb_dir.mkdir(parents=True, exist_ok=True)
            # The config as config.toml has it: no token reaches W&B's files or servers.
            # console="off": W&B would otherwise wrap this process's stdout to copy it to its files.
            self._wandb = wandb.init(project=run.wandb_project, name=run.dir.name, dir=str(run_dir.wandb_dir),
                                     mode=run.wandb_mode, config=tomllib.loads(to_toml(config)),
                                     settings=wandb.Settings(console="off"))
            log(f"fleetrl: W&B run {self._wandb.id} ({run.wandb_mode}) in {run_dir.wandb_dir}")

    def write(self, line: StepLine) -> None:
        """metrics.jsonl first: a kill after it loses no step the record has."""
        self.run_dir.append_metrics(line)
        self._chart(line.step, line.to_dict())
        if self.view is not None:
            self.view.step_done(line.step, f"reward {line.batch.reward_mean:.3f}")
        for text in outlier_texts(line):
            self.log(text)
        self.log(step_text(line, self.max_steps, self.dynamic_sampling))

    def write_sft(self, line: SftLine) -> None:
        """A `fleetrl sft` step's line, to the same places as `write`'s."""
        self.run_dir.append_metrics(line)
        self._chart(line.step, line.to_dict())
        loss = f"{line.loss:.4f}" if line.loss is not None else "n/a"
        if self.view is not None:
            self.view.step_done(line.step, f"loss {loss}")
        self.log(f"step {line.step}/{self.max_steps}  loss {loss}  {line.sequences} sequences, {line.loss_tokens} "
                 f"trained of {line.tokens} tokens in {line.micro_batches} micro-batch(es)  lr {line.lr:.1e}  "
                 f"grad norm {line.grad_norm if line.grad_norm is None else f'{line.grad_norm:.3f}'}  "
                 f"train {line.train_finished - line.train_started:.1f}s")

    def write_eval(self, version: int, figures: dict[str, EvalFigures]) -> None:
        """An evaluation no step's line carries (the version the run starts from): charted at its
        version; eval.jsonl is its record (orchestrator/evaluation.py)."""
        self._chart(version, {"eval": {name: f.to_dict() for name, f in figures.items()}})

    def _chart(self, step: int, line: dict) -> None:
        values = scalars(line)
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
            self._tensorboard.flush()  # a kill loses no step that metrics.jsonl has
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        """Idempotent: the run closes them before its manifest, and again on any way out."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # W&B's service process (wandb-core) ends here, not with this process
            self._wandb = None
