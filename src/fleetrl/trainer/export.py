"""A checkpoint, or the weights of a version, as a Hugging Face folder: the trained model, to take anywhere.

    OUT_DIR/  model.safetensors, config.json, generation_config.json (when the base model has
              one), the tokenizer's files, and fleetrl_version.json: the policy version of the
              weights ({"version": N}), which `fleetrl eval` labels their tokens with

The architecture and the tokenizer are the base model's (the folder the run trained from); the
weights are a checkpoint's (`fleetrl export`) or the last published version's (every run's
RUN_DIR/final_model), fp32 as trained. transformers and vLLM load the folder like any
other.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from fleetrl.errors import FleetrlError
from fleetrl.trainer import checkpoint
from fleetrl.trainer.model import load_policy


VERSION_FILE = "fleetrl_version.json"


def folder_version(folder: Path) -> int | None:
    """The policy version a folder fleetrl wrote holds (None: a folder of no fleetrl run)."""
    path = folder / VERSION_FILE
    return json.loads(path.read_text())["version"] if path.is_file() else None


def export_hf(model_dir: Path, folder: Path, out_dir: Path, version: int) -> None:
    """Write the checkpoint in `folder` (of a model whose base is `model_dir`), of policy
    `version`, to `out_dir`."""
    model = load_policy(model_dir, torch.device("cpu"), sharded=False).eval()
    checkpoint.load_weights(folder, model)
    _write_folder(model_dir, model, out_dir, version)


def export_weights(model_dir: Path, weights: Iterable[tuple[str, torch.Tensor]], out_dir: Path,
                   version: int) -> None:
    """Write full tensors (as `trainer.model.named_tensors` yields them: tied weights once) of a
    model whose base is `model_dir` to `out_dir`: the run's final model, from the snapshot it
    published last, so a run writes one without a checkpoint of its last step."""
    # Unsharded, in rank 0 alone while the other ranks wait: no collective.
    model = load_policy(model_dir, torch.device("cpu"), sharded=False).eval()
    params = dict(model.named_parameters())  # tied weights under their first name, as sent
    missing = set(params)
    with torch.no_grad():
        for name, tensor in weights:
            if name not in params:
                raise FleetrlError(f"export: weight {name} is not a parameter of the model in {model_dir}")
            params[name].copy_(tensor)
            missing.discard(name)
    if missing:
        raise FleetrlError(f"export: no weight given for {sorted(missing)[0]} (and {len(missing) - 1} more)")
    _write_folder(model_dir, model, out_dir, version)


def _write_folder(model_dir: Path, model: torch.nn.Module, out_dir: Path, version: int) -> None:
    """`out_dir`, a new folder: written beside it, then renamed, so a failure leaves no half folder."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    if out_dir.exists():
        raise FleetrlError(f"{out_dir} exists: export writes a new folder (remove it, or name another)")
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.config.use_cache = AutoConfig.from_pretrained(model_dir).use_cache  # training turned it off
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
        if (model_dir / "generation_config.json").exists():
            GenerationConfig.from_pretrained(model_dir).save_pretrained(tmp)
        (tmp / VERSION_FILE).write_text(json.dumps({"version": version}) + "\n")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
