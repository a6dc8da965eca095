"""`fleetrl eval [MODEL_OR_RUN]`: a saved model scored on the environments of a run's evaluation,
printed as a table, its records written to a folder of their own. MODEL_OR_RUN is a Hugging Face
model folder, a run directory (its final model or a checkpoint, with its config.toml), or nothing
(the config's own model); what is scored is `[eval]`, through the same Evaluator as `fleetrl rl`,
at the model's one version on launched or held attached workers. Which model, at which version,
with which config, and what OUT holds: docs/quickstart.md, section 4; docs/environments.md,
"Evaluation and the held-out split"."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fleetrl.app.checks import eval_environments
from fleetrl.app.export import find_checkpoint
from fleetrl.app.orchestration import build_evaluator, build_orchestrator
from fleetrl.app.providers import base_weights, build_fleet, build_transport
from fleetrl.app.status import aligned
from fleetrl.config import Config
from fleetrl.envs.mix import RunEnv
from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet import Fleet
from fleetrl.model import resolve_model
from fleetrl.records import EvalFigures
from fleetrl.rundir import RunDir
from fleetrl.trainer.export import VERSION_FILE, export_hf, folder_version

def to_stderr(line: str) -> None:
    """The command's progress lines: stdout is the table's."""
    print(line, file=sys.stderr)


@dataclass(frozen=True)
class SavedModel:
    """What `fleetrl eval` scores: a model folder, or a run's checkpoint to export first."""

    folder: Path | None  # a Hugging Face folder; None: `checkpoint`'s, written once all is checked
    checkpoint: Path | None  # a run's checkpoint folder, where `folder` is None
    version: int  # the policy version its tokens carry
    name: str  # what it is, for the progress lines


@dataclass(frozen=True)
class EvalPlan:
    """Everything `fleetrl eval` checked before it starts anything."""

    model: SavedModel
    out: RunDir  # a new folder: the records' (as a run directory has them) and the launched workers' logs
    envs: list[RunEnv]
    run: RunDir | None  # the run directory the model is of: held while it is scored, so no run replaces it


def config_files(model_or_run: Path | None) -> list[Path]:
    """The config files `fleetrl eval MODEL_OR_RUN` starts from, under its own: the config.toml
    of the run directory it is or lies in (a run's final_model/); none for another model folder,
    or without MODEL_OR_RUN (the config's own model). Anything else is refused, naming it."""
    if model_or_run is None:
        return []
    if is_model_folder(model_or_run):  # a run's final_model/, say, is scored as the run evaluates
        run = run_of(model_or_run.absolute().parent)
        return [run.config_path] if run is not None else []
    run = RunDir(model_or_run)
    if run.config_path.is_file():
        return [run.config_path]
    if not model_or_run.exists():
        raise FleetrlError(f"MODEL_OR_RUN {model_or_run} does not exist")
    raise FleetrlError(f"MODEL_OR_RUN {model_or_run} is neither a Hugging Face model folder (no config.json) nor a "
                       "run directory (no config.toml)")


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def plan(config: Config, model_or_run: Path | None, step: int | None, out: Path | None,
         log=to_stderr) -> EvalPlan:
    """What `fleetrl eval` (and its --dry-run) refuses before it starts anything: the model, a
    folder to write that exists already or lies inside a run directory, an environment that
    cannot be evaluated. No MODEL_OR_RUN: the config's own model, into --out."""
    if model_or_run is None:
        if out is None:
            raise FleetrlError("fleetrl eval without MODEL_OR_RUN scores the config's own model (model.path, else "
                               "the embedded default): name a new folder for its records with --out DIR")
        model_or_run = resolve_model(config.model, log)
    model = find_model(config, model_or_run, step, log)
    if out is None and (out := default_out(model_or_run, model.version)).exists():
        raise FleetrlError(f"{out}, where fleetrl eval writes the records by default, exists: remove it, or name "
                           "another folder with --out DIR")
    if out.exists():
        raise FleetrlError(f"--out {out} exists: fleetrl eval writes a new folder (remove it, or name another)")
    if (run := run_of(out.absolute().parent)) is not None:
        raise FleetrlError(f"--out {out} is inside the run directory {run.root}: `fleetrl verify` refuses files its "
                           "manifest does not list (name a folder outside it)")
    out_dir = RunDir(out)
    return EvalPlan(model, out_dir, eval_environments(config, out_dir, None, "fleetrl eval"),
                    run_of(model_or_run.absolute()))


def run_of(path: Path) -> RunDir | None:
    """The run directory `path` is, or lies inside; None if none."""
    return next((run for run in map(RunDir, (path, *path.parents)) if run.config_path.is_file()), None)


def find_model(config: Config, model_or_run: Path, step: int | None, log=to_stderr) -> SavedModel:
    """The model MODEL_OR_RUN names (`config_files` has checked it is a model folder or a run
    directory) at its version: the one fleetrl recorded in the folder (a run's final model, an
    export), else 0; a checkpoint's step."""
    if is_model_folder(model_or_run):
        if step is not None:
            raise FleetrlError(f"--step {step}: {model_or_run} is a model folder, not a run directory with checkpoints")
        return SavedModel(model_or_run, None, folder_version(model_or_run) or 0, str(model_or_run))
    run = RunDir(model_or_run)
    if step is None and run.final_model_dir.is_dir():
        if (version := folder_version(run.final_model_dir)) is None:
            raise FleetrlError(f"{run.final_model_dir} has no {VERSION_FILE} (a final model of an older fleetrl) to "
                               "say which version it is: score a checkpoint with --step N")
        return SavedModel(run.final_model_dir, None, version, str(run.final_model_dir))
    step, folder = find_checkpoint(run, step, config, log)
    return SavedModel(None, folder, step, f"the checkpoint of step {step} of {run.root}")


def default_out(model_or_run: Path, version: int) -> Path:
    """Beside MODEL_OR_RUN, named after it: runs/default-eval-v5 for a run at v5, FOLDER-eval for
    a model folder. A model folder inside a run directory (its final_model/, say) has its
    results beside the run instead: runs/default-final_model-eval."""
    source = Path(os.path.abspath(model_or_run))
    if not is_model_folder(source):
        return source.with_name(f"{source.name}-eval-v{version}")
    if (run := run_of(source.parent)) is not None:
        return run.root.with_name(f"{run.root.name}-{source.name}-eval")
    return source.with_name(f"{source.name}-eval")


def run_eval(config: Config, model_or_run: Path, step: int | None, out: Path | None) -> int:
    # Every part logs with print (the fleet, the launcher, the export, the evaluator): while the
    # command works those lines are its progress, on stderr; stdout carries the table alone.
    with contextlib.redirect_stdout(sys.stderr):
        checked = plan(config, model_or_run, step, out)
        figures = score(config, checked)
    print(table(figures, config.eval.samples_per_prompt))
    to_stderr(f"fleetrl eval: records in {checked.out.eval_path} and "
              f"{checked.out.eval_records_path(checked.model.version)}")
    return 0


def score(config: Config, checked: EvalPlan) -> dict[str, EvalFigures]:
    """Scores the model in OUT, locked for the command (a second `fleetrl eval` into it is
    refused), with the run directory it is of locked too (a running run is refused; no run
    started meanwhile replaces its final model or checkpoints): a checkpoint is exported into a
    temporary folder in OUT first."""
    model, out_dir, source = checked.model, checked.out, checked.run
    if source is not None:
        source.lock()
    try:
        out_dir.lock()
        with tempfile.TemporaryDirectory(dir=out_dir.root, prefix=".model-") as scratch:
            folder = model.folder or export_checkpoint(config, model, Path(scratch) / "model")
            # The launched workers serve that folder and log into OUT, labelled with OUT's run id
            # (RunDir.run_id: OUT is new, so one drawn for this command alone), so a run's own
            # labels on attached workers are never taken for ours.
            config = config.model_copy(update={"model": config.model.model_copy(update={"path": folder}),
                                               "run": config.run.model_copy(update={"dir": out_dir.root})})
            print(f"fleetrl eval: {model.name} at v{model.version}: {config.eval.prompts} prompt(s) of "
                  f"{', '.join(e.name for e in checked.envs)}, {config.eval.samples_per_prompt} completion(s) each "
                  f"-> {out_dir.root}")
            model_dir = resolve_model(config.model)
            fleet = build_fleet(config, out_dir, model_dir)
            return asyncio.run(evaluate(config, fleet, model_dir, model.version, checked.envs, out_dir))
    finally:
        out_dir.close()
        if source is not None:
            source.close()


def export_checkpoint(config: Config, model: SavedModel, folder: Path) -> Path:
    """The checkpoint as a Hugging Face folder, with `fleetrl export`'s code."""
    print(f"fleetrl eval: exporting {model.name} to a temporary folder")
    export_hf(resolve_model(config.model), model.checkpoint, folder, model.version)
    return folder


async def evaluate(config: Config, fleet: Fleet, model_dir: Path, version: int, envs: list[RunEnv],
                   out_dir: RunDir) -> dict[str, EvalFigures]:
    """Builds the evaluator on the fleet, as `fleetrl rl` does before its fleet starts; brings
    the fleet's workers to the model in `model_dir` at `version` (launched ones load it;
    attached ones are held to its weights), evaluates it, and stops the fleet."""
    from transformers import AutoTokenizer

    transport = build_transport(config, out_dir)
    try:
        weights = base_weights(fleet.provider, model_dir, transport, version)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        orchestrator = build_orchestrator(config, fleet, envs, tokenizer, out_dir)
        evaluator = build_evaluator(config, orchestrator, envs, out_dir)
        await fleet.start(weights, launched_version=version)
        return await evaluator.evaluate(version)
    finally:
        await transport.close()
        await fleet.close()


def table(figures: dict[str, EvalFigures], k: int) -> str:
    """An evaluation's figures, an environment a row: the mean reward and its standard error
    (reward_se); pass@k for k = eval.samples_per_prompt when it is more than 1 (else it is
    pass@1). "-": nothing of it could be scored (reward_se: fewer than two prompts)."""
    def cell(value) -> str:
        return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    ks = [1, k] if k > 1 else [1]
    header = ("environment", "prompts", "completions", "reward_mean", "reward_se", *(f"pass@{n}" for n in ks), "failed")
    rows = [(name, *map(cell, (f.prompts, f.samples, f.reward_mean, f.reward_se, *(f.pass_at[n] for n in ks),
                               f.failed)))
            for name, f in figures.items()]
    return "\n".join(aligned([header, *rows]))
