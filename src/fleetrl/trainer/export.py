"""A checkpoint, or the weights of a version, as a Hugging Face folder: the trained model, to take anywhere.

    OUT_DIR/  model.safetensors, config.json, generation_config.json (when the base model has
              one), the tokenizer's files, and fleetrl_version.json: the policy version of the
              weights ({"version": N}), which `fleetrl eval` labels their tokens with

A LoRA run's model is written merged (the base with the adapter added in: no peft needed to
load it); `fleetrl export --adapter` writes the adapter alone instead, as a peft adapter folder:

    OUT_DIR/  adapter_config.json, adapter_model.safetensors, fleetrl_version.json

The architecture and the tokenizer are the base model's (the folder the run trained from); the
weights are a checkpoint's (`fleetrl export`) or the last published version's (every run's
RUN_DIR/final_model), fp32 as trained. transformers and vLLM load the folder like any
other.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from fleetrl.errors import FleetrlError
from fleetrl.trainer import checkpoint
from fleetrl.lora import write_adapter
from fleetrl.trainer.lora import adapter_params, has_adapter, merge
from fleetrl.trainer.model import load_policy, published_params


VERSION_FILE = "fleetrl_version.json"


def folder_version(folder: Path) -> int | None:
    """The policy version a folder fleetrl wrote holds (None: a folder of no fleetrl run)."""
    path = folder / VERSION_FILE
    return json.loads(path.read_text())["version"] if path.is_file() else None


def export_hf(model_dir: Path, folder: Path, out_dir: Path, version: int, adapter_only: bool = False) -> None:
    """Write the checkpoint in `folder` (of a model whose base is `model_dir`), of policy
    `version`, to `out_dir`: a whole model (a LoRA checkpoint's adapter merged into the base), or
    with `adapter_only` a LoRA checkpoint's adapter as a peft adapter folder."""
    adapter = checkpoint.adapter_of(folder)
    if adapter_only and adapter is None:
        raise FleetrlError(f"checkpoint {folder} holds all the weights, no LoRA adapter (trainer.lora.rank = 0): "
                           "export it without --adapter")
    model = load_policy(model_dir, torch.device("cpu"), sharded=False, adapter=adapter).eval()
    checkpoint.load_weights(folder, model)
    if adapter_only:
        _new_folder(out_dir, version, lambda tmp: write_adapter(tmp, adapter, adapter_params(model)))
    else:
        _write_model(model_dir, model, out_dir, version)


def export_weights(model_dir: Path, weights: Iterable[tuple[str, torch.Tensor]], out_dir: Path,
                   version: int, adapter: dict | None = None) -> None:
    """Write the full tensors of a published version (as `trainer.model.named_tensors` yields
    them: tied weights once; with LoRA the adapter `adapter`'s alone) of a model whose base is
    `model_dir` to `out_dir`, a whole model (the adapter merged into the base): the run's final
    model, from the snapshot it published last, so a run writes one without a checkpoint of its
    last step."""
    # Unsharded, in rank 0 alone while the other ranks wait: no collective.
    model = load_policy(model_dir, torch.device("cpu"), sharded=False, adapter=adapter).eval()
    _fill(model_dir, dict(published_params(model)), weights)
    _write_model(model_dir, model, out_dir, version)


def _fill(model_dir: Path, params: dict[str, torch.nn.Parameter], weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies `weights` into `params` by name; every one of `params` must be given."""
    missing = set(params)
    with torch.no_grad():
        for name, tensor in weights:
            if name not in params:
                raise FleetrlError(f"export: weight {name} is not a parameter of the model in {model_dir}")
            params[name].copy_(tensor)
            missing.discard(name)
    if missing:
        raise FleetrlError(f"export: no weight given for {sorted(missing)[0]} (and {len(missing) - 1} more)")


def _write_model(model_dir: Path, model: torch.nn.Module, out_dir: Path, version: int) -> None:
    """`model` as a Hugging Face folder; a model with a LoRA adapter as the base model with the
    adapter merged in, which loads with no peft (a second, plain copy of the base is built to
    hold the merged weights under their own names)."""
    if has_adapter(model):
        merged = merge(model)
        model = load_policy(model_dir, torch.device("cpu"), sharded=False).eval()
        _fill(model_dir, dict(model.named_parameters()), merged)
    _new_folder(out_dir, version, lambda tmp: _write_hf_files(model_dir, model, tmp))


def _write_hf_files(model_dir: Path, model: torch.nn.Module, folder: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    model.config.use_cache = AutoConfig.from_pretrained(model_dir).use_cache  # training turned it off
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    if (model_dir / "generation_config.json").exists():
        GenerationConfig.from_pretrained(model_dir).save_pretrained(folder)


def _new_folder(out_dir: Path, version: int, write: Callable[[Path], None]) -> None:
    """`out_dir`, a new folder of what `write` puts in the folder it is given, and the version
    file: written beside it, then renamed, so a failure leaves no half folder."""
    if out_dir.exists():
        raise FleetrlError(f"{out_dir} exists: export writes a new folder (remove it, or name another)")
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        (tmp / VERSION_FILE).write_text(json.dumps({"version": version}) + "\n")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
