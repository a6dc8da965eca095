"""The run's metrics, in the tools RL users already read: TensorBoard event files in the run
directory (by default, offline) and, when `run.wandb` is set, Weights & Biases (offline unless
`run.wandb_mode` says otherwise).

Each trainer step's metrics line (app/rl.py, the same one metrics.jsonl gets) is logged at its
step: every number of the line under its own name, each worker's numbers under
`worker/<id>/<name>`, each environment's under `env/<name>/<name>`, and each evaluation's under
`eval/<environment>/<name>` at the evaluated version. metrics.jsonl stays the record `fleetrl verify` reads; these are views of it.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from fleetrl.config import Config, RunConfig, to_toml
from fleetrl.errors import FleetrlError

# Fields of a metrics line that are no measure to chart: wall-clock stamps and identities.
NOT_CHARTED = ("step", "rollout_started", "rollout_finished", "train_started", "train_finished")


def scalars(line: dict) -> dict[str, float]:
    """The numbers of one metrics line, by chart name (None and text are left out)."""
    out = {key: float(value) for key, value in line.items()
           if key not in NOT_CHARTED and isinstance(value, int | float)}
    for nested, prefix in (("workers", "worker"), ("envs", "env"), ("eval", "eval")):
        for name, values in (line.get(nested) or {}).items():
            out.update({f"{prefix}/{name}/{key}": float(value) for key, value in values.items()
                        if isinstance(value, int | float)})
    return out


class Monitors:
    """Where each step's metrics go besides metrics.jsonl; `close` flushes them all."""

    def __init__(self, run: RunConfig, config: Config, tensorboard_dir: Path, wandb_dir: Path, log=print) -> None:
        self._tensorboard = self._wandb = None
        if run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(tensorboard_dir))
            log(f"fleetrl: TensorBoard event files in {tensorboard_dir} (tensorboard --logdir {tensorboard_dir})")
        if run.wandb:
            try:
                import wandb
            except ImportError:
                raise FleetrlError("run.wandb = true but the wandb package is not installed "
                                   "(pip install -e '.[wandb]')") from None
            wandb_dir.mkdir(parents=True, exist_ok=True)
            # The config as config.toml has it: no token reaches W&B's files or servers.
            # console="off": W&B would otherwise wrap this process's stdout to copy it to its files.
            self._wandb = wandb.init(project=run.wandb_project, name=run.dir.name, dir=str(wandb_dir),
                                     mode=run.wandb_mode, config=tomllib.loads(to_toml(config)),
                                     settings=wandb.Settings(console="off"))
            log(f"fleetrl: W&B run {self._wandb.id} ({run.wandb_mode}) in {wandb_dir}")

    def log(self, line: dict) -> None:
        values = scalars(line)
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, global_step=line["step"])
            self._tensorboard.flush()  # a kill loses no step that metrics.jsonl has
        if self._wandb is not None:
            self._wandb.log(values, step=line["step"])

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
