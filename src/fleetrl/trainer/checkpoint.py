"""Trainer checkpoints: model, optimizer and step, saved atomically, the last K kept.

Format: `torch.distributed.checkpoint` (DCP) with the sharded state dicts of
`get_state_dict` / `set_state_dict`. Each rank writes only its own shards, in parallel, so no
rank ever holds the full model and optimizer (a full state dict gathered on rank 0 needs three
model-sized copies in one process); DCP also reshards on load, so a checkpoint written by N
ranks loads into M, one included. The price is that every rank must see the same directory
(shared storage across nodes), as the batches already require.

Atomicity: a checkpoint is written into `.tmp-step_N`, then rank 0 writes `complete.json`
inside it (after DCP's own metadata, which is written last by DCP) and renames the folder to
`step_N`. `latest()` trusts only `step_N` folders holding a readable `complete.json` for step N;
a crash at any point leaves either the previous checkpoints or the new complete one.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fleetrl.files import atomic_write, fsync_dir
from fleetrl.rundir import STEP_PREFIX, step_name, step_of
from fleetrl.trainer import distributed

COMPLETE = "complete.json"


def latest(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under `root` as (step, folder), or None."""
    found = []
    for folder in Path(root).glob(f"{STEP_PREFIX}*"):
        step = _complete_step(folder)
        if step is not None:
            found.append((step, folder))
    return max(found, default=None)


def save(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, keep: int) -> Path:
    """Saves a checkpoint of `step` and keeps the newest `keep`; every rank must call this."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
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
    with _single_process_quiet():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    _barrier()  # every rank's shards are on disk

    if distributed.rank() == 0:
        atomic_write(tmp / COMPLETE, json.dumps({"step": step, "world_size": distributed.world_size()}), durable=True)
        fsync_dir(tmp)
        if final.exists():  # a step saved again (a resumed run): the new one replaces it
            stale = root / f".stale-{final.name}"
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale)
        else:
            os.rename(tmp, final)
        fsync_dir(root)
        _prune(root, keep)
    _barrier()
    return final


def load(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int | None:
    """Restores the newest complete checkpoint into `model` and `optimizer` and returns its
    step, or returns None when there is none; every rank must call this."""
    found = latest(root)
    if distributed.world_size() > 1:
        # Rank 0's listing decides, so no rank can pick another checkpoint than its peers.
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    if found is None:
        return None
    step, folder = found
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return step


def _complete_step(folder: Path) -> int | None:
    try:
        step = step_of(folder)
        record = json.loads((folder / COMPLETE).read_text())
    except (ValueError, OSError):
        return None
    return step if record.get("step") == step else None


def _prune(root: Path, keep: int) -> None:
    complete = sorted((s, f) for f in root.glob(f"{STEP_PREFIX}*") if (s := _complete_step(f)) is not None)
    for _, folder in complete[:-keep]:
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
