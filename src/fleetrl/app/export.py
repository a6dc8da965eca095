"""`fleetrl export RUN_DIR OUT_DIR [--step N] [--adapter]`: a run's checkpoint as a Hugging Face folder
(a LoRA run's adapter merged in), or a LoRA run's adapter alone as a peft adapter folder."""

from __future__ import annotations

from pathlib import Path

from fleetrl.config import Config
from fleetrl.errors import FleetrlError
from fleetrl.model import resolve_model
from fleetrl.rundir import RunDir
from fleetrl.trainer import checkpoint
from fleetrl.trainer.export import export_hf


def run_export(run_dir: Path, out_dir: Path, step: int | None, adapter_only: bool = False, log=print) -> int:
    """Export the checkpoint of `step` (default: the newest complete one) of the run in `run_dir`;
    `adapter_only`: its LoRA adapter alone."""
    run = RunDir(run_dir)
    if not run.config_path.exists():
        raise FleetrlError(f"{run_dir}: no config.toml (not a run directory)")
    config = run.read_config()
    if adapter_only and not config.trainer.lora.enabled:
        raise FleetrlError(f"fleetrl export --adapter: {run_dir} trained all the weights, no LoRA adapter "
                           "(trainer.lora.rank = 0); export it without --adapter")
    step, folder = find_checkpoint(run, step, config, log)
    log(f"fleetrl export: step {step} of {run_dir} -> {out_dir}")
    export_hf(resolve_model(config.model), folder, out_dir, version=step, adapter_only=adapter_only)
    what = ("a peft adapter folder: peft's PeftModel.from_pretrained and vLLM's --lora-modules load it on the base "
            "model" if adapter_only else "a Hugging Face folder: transformers' from_pretrained and vLLM load it; "
            "docs/quickstart.md serves it")
    log(f"fleetrl export: done: {out_dir} ({what})")
    return 0


def find_checkpoint(run: RunDir, step: int | None, config: Config, log=print) -> tuple[int, Path]:
    """(step, folder) of the run's checkpoint of `step`, default the newest complete one
    (`config`: the run's); FleetrlError naming what is missing."""
    if step is not None:
        return step, checkpoint.at_step(run.checkpoints_dir, step)
    found = checkpoint.latest(run.checkpoints_dir, log)
    if found is None:
        raise FleetrlError(f"{run.root}: no complete checkpoint to export (its config has trainer.checkpoint_interval "
                           f"= {config.trainer.checkpoint_interval})")
    return found
