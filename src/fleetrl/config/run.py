"""`[run]`: the run directory, steps and seed, how CPUs are shared out, and where each step's
metrics are shown and logged (live view, TensorBoard, W&B)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from fleetrl.config.section import Section


class RunConfig(Section):
    dir: Path = Field(Path("runs/latest"), description="Run directory: config, logs, metrics.")
    max_steps: int = Field(10, ge=1, description="Trainer steps (= policy versions) to run.")
    seed: int = Field(0, description="Seed for sampling and training.")
    core_plan: Literal["workers", "auto", "off"] = Field(
        "workers", description="workers: when `fleetrl rl` launches two inference workers or more, each gets CPUs "
        "of its own where inference.vllm.omp_threads_bind is empty; one worker, and the trainer ranks, go where the "
        "OS puts them. auto: "
        "the launched workers and the trainer ranks all get CPUs of their own, where trainer.cpu_cores is empty "
        "too (not under torchrun). off: the OS places everything. The plan is printed at the start.")
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
