"""Trainer checkpoints: model, optimizer and step (with LoRA, the adapter alone), saved by every
rank as DCP shards into `.tmp-step_N` and renamed to `step_N` once `complete.json` records every
file's size and sha256; the last K kept, and `latest()` skips one that does not match its record.
Format, atomicity and integrity: docs/design/trainer.md, "Checkpoints"."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from pydantic import Field
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fleetrl import failpoints
from fleetrl.errors import FleetrlError
from fleetrl.files import atomic_write, fsync_dir, sha256_file
from fleetrl.rundir import STEP_PREFIX, step_name, step_of
from fleetrl.strict import Strict
from fleetrl.trainer import distributed
from fleetrl.lora import ADAPTER_CONFIG_FILE
from fleetrl.trainer.lora import has_adapter
from fleetrl.trainer.model import first_nonfinite, local_shards

COMPLETE = "complete.json"
# Loading is not strict: the model's frozen parameters are missing from what is loaded by design
# (`_trained`); `_check_holds` makes sure instead that the checkpoint has every key that is loaded.
_LOADED = StateDictOptions(strict=False)


class CheckpointFile(Strict):
    """One file of a checkpoint, as its completion record lists it."""

    size: int
    sha256: str


class CheckpointRecord(Strict):
    """complete.json, written once every rank's files are on disk: the checkpoint's step and
    world size, the mark that its weights were checked finite, and each file's size and sha256.
    One from before December 2026 has neither the mark nor the files: it reads, and is skipped."""

    step: int
    world_size: int
    finite: bool = False
    files: dict[str, CheckpointFile] = Field(default_factory=dict)


def _trained(model_state: dict, model: nn.Module) -> dict:
    """`model_state` without the frozen parameters (LoRA's base: the base model's folder has them),
    under every name they go by: torch's `ignore_frozen_params` keeps a tied alias (the head of
    tied embeddings, `lm_head.weight`), which would put the whole embedding into every checkpoint.
    With nothing frozen (full fine-tuning) this is all of `model_state`."""
    frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
    return {key: value for key, value in model_state.items() if key not in frozen}


def latest(root: Path, log: Callable[[str], None] = print) -> tuple[int, Path] | None:
    """The newest checkpoint under `root` whose files match its record, as (step, folder), or
    None. Each newer folder that does not is skipped with a line to `log` saying why."""
    for step, folder in reversed(_step_folders(Path(root))):
        problem = _verify(folder)
        if problem is None:
            return step, folder
        log(f"fleetrl: checkpoint {folder} skipped: {problem}")
    return None


def at_step(root: Path, step: int) -> Path:
    """The checkpoint folder of `step` under `root`, verified like `latest`'s; FleetrlError
    naming what is wrong (or which steps there are) otherwise."""
    folders = dict(_step_folders(Path(root)))
    if step not in folders:
        have = ", ".join(map(str, sorted(folders))) or "none"
        raise FleetrlError(f"no checkpoint of step {step} in {root} (steps checkpointed: {have})")
    problem = _verify(folders[step])
    if problem is not None:
        raise FleetrlError(f"checkpoint {folders[step]}: {problem}")
    return folders[step]


def load_weights(folder: Path, model: nn.Module) -> None:
    """The model's weights from the checkpoint in `folder` (a verified one: `latest`, `at_step`),
    without its optimizer state; every rank of a sharded model must call this. A LoRA
    checkpoint's adapter goes into a model built with its adapter (`adapter_of`)."""
    state = {"model": _trained(get_model_state_dict(model), model)}
    _check_holds(folder, state["model"])
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"], options=_LOADED)


def adapter_of(folder: Path) -> dict | None:
    """The config of the LoRA adapter the checkpoint in `folder` holds (`lora.adapter_config`),
    or None for a checkpoint of all the weights."""
    path = Path(folder) / ADAPTER_CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, keep: int,
         adapter: dict | None = None) -> Path:
    """Saves a checkpoint of `step` and keeps the newest `keep`; every rank must call this.
    `adapter`: the config of the model's LoRA adapter (`lora.adapter_config`), None without one.
    Raises FleetrlError, saving nothing, when a parameter is not finite."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if has_adapter(model) != (adapter is not None):
        raise ValueError("a model with a LoRA adapter is saved with its adapter's config, and only such a model")
    bad = first_nonfinite(local_shards(model), across_ranks=True)
    if bad is not None:
        raise FleetrlError(f"step {step}: parameter {bad} is not finite; checkpoint not saved")
    root = Path(root)
    final = root / step_name(step)
    tmp = root / f".tmp-{final.name}"
    if distributed.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in [*root.glob(".tmp-*"), *root.glob(".stale-*")]:  # earlier saves that crashed
            shutil.rmtree(leftover)
        tmp.mkdir()
    _barrier()

    model_state, optim_state = get_state_dict(model, optimizer)
    model_state = _trained(model_state, model)
    with _single_process_quiet():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    _barrier()  # every rank's shards are on disk

    if distributed.rank() == 0:
        failpoints.hold("checkpoint", step)
        if adapter is not None:  # listed with its checksum below, as every file of the folder
            (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter, indent=1))
        files = {path.relative_to(tmp).as_posix(): CheckpointFile(size=path.stat().st_size, sha256=sha256_file(path))
                 for path in sorted(tmp.rglob("*")) if path.is_file()}
        record = CheckpointRecord(step=step, world_size=distributed.world_size(), finite=True, files=files)
        atomic_write(tmp / COMPLETE, json.dumps(record.to_dict(), indent=1), durable=True)
        fsync_dir(tmp)
        if final.exists():  # a step saved again (a resumed run): the new one replaces it
            stale = root / f".stale-{final.name}"
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale)
        else:
            os.rename(tmp, final)
        fsync_dir(root)
        _prune(root, keep, final)
    _barrier()
    return final


def load(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         log: Callable[[str], None] = print) -> int | None:
    """Restores the newest good checkpoint (`latest`) into `model` and `optimizer` and returns
    its step, or returns None when there is none; every rank must call this."""
    if distributed.world_size() > 1:
        # Rank 0 alone verifies (one read of the files, not one per rank), and its choice is
        # every rank's, so no rank can pick another checkpoint than its peers.
        box = [latest(root, log) if distributed.rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    else:
        found = latest(root, log)
    if found is None:
        return None
    step, folder = found
    model_state, optim_state = get_state_dict(model, optimizer)
    model_state = _trained(model_state, model)
    _check_holds(folder, model_state)
    state = {"model": model_state, "optimizer": optim_state}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_LOADED)
    return step


def _check_holds(folder: Path, model_state: dict) -> None:
    """FleetrlError, in one line, when the checkpoint lacks a weight `model_state` asks for: it
    was written by a run that trained other weights (all of them, or another LoRA adapter)."""
    stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    missing = [key for key in model_state if f"model.{key}" not in stored]
    if missing:
        raise FleetrlError(f"checkpoint {folder} holds no {missing[0]} ({len(missing)} weights missing): it is not a "
                           "checkpoint of this model (trained with another trainer.lora?)")


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_N` folder under `root`, oldest first."""
    found = []
    for folder in root.glob(f"{STEP_PREFIX}*"):
        try:
            found.append((step_of(folder), folder))
        except ValueError:  # not a name fleetrl gives
            continue
    return sorted(found)


def _record(folder: Path) -> CheckpointRecord | None:
    """The completion record in `folder` when it is readable and for the folder's step."""
    path = folder / COMPLETE
    try:
        record = CheckpointRecord.read(json.loads(path.read_text()), str(path))
    except (ValueError, OSError):  # torn JSON, or no CheckpointRecord (a RecordError)
        return None
    return record if record.step == step_of(folder) else None


# Folders verified in this process, with the (record, sizes, modification times) they were
# verified at: `fleetrl rl` asks for the latest checkpoint twice as it resumes (to pick the
# step, then to load it), and the second answer needs no second read of a GB while the
# files stay as they were.
_verified: dict[Path, tuple] = {}


def _verify(folder: Path) -> str | None:
    """What is wrong with the checkpoint in `folder`, naming the file, or None when its
    record is complete and every file it lists is there with its size and sha256."""
    record = _record(folder)
    if record is None:
        return f"no readable {COMPLETE} for its step (a save that never finished, or a torn copy)"
    if not record.finite or not record.files:
        return f"{COMPLETE} lacks the checksums or the finite-weights mark that fleetrl writes"
    seen = []
    for name, expected in record.files.items():
        try:
            stat = (folder / name).stat()
        except FileNotFoundError:
            return f"{name} is missing"
        if stat.st_size != expected.size:
            return f"{name} is {stat.st_size} bytes, {COMPLETE} records {expected.size} (truncated?)"
        seen.append((name, stat.st_size, stat.st_mtime_ns))
    state = (record, tuple(seen))
    if _verified.get(folder) == state:
        return None
    for name, expected in record.files.items():
        if sha256_file(folder / name) != expected.sha256:
            return f"{name} does not match its sha256 in {COMPLETE} (corrupted)"
    _verified[folder] = state
    return None


def _prune(root: Path, keep: int, saved: Path) -> None:
    """Deletes the complete checkpoints older than the newest `keep`, but never `saved`.

    `saved`, just written, is the newest checkpoint known to be good: its weights were checked
    finite and its checksums computed from its files a moment ago. Yet it is not always among
    the newest `keep` by step: when a resume skipped a corrupted checkpoint, that one numbers
    past the resume step until the run saves its step again, and it must not push the good
    one out. (The other checkpoints are not verified here: that would read all of them at
    every save.)
    """
    complete = [(step, folder) for step, folder in _step_folders(root) if _record(folder) is not None]
    for _, folder in complete[:-keep]:
        if folder != saved:
            shutil.rmtree(folder)


@contextmanager
def _single_process_quiet():
    """A one-rank trainer has no process group by design; DCP warns about that on every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process")
        yield


def _barrier() -> None:
    if distributed.world_size() > 1:
        dist.barrier()
