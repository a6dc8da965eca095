"""LoRA through peft: the adapter on the trainer's model, and the names under which its tensors are
published, checkpointed and exported (`trainer.lora`; off while its rank is 0). The adapter is
injected in place, so the model stays a transformers causal LM, and starts at B = 0, so a fresh
one computes the base model's logits. Why, and how peft's names map to fleetrl's:
docs/design/trainer.md, "LoRA"."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fleetrl.config import LoraConfig
from fleetrl.lora import PEFT_ADAPTER, adapter_key

# A's initial values are drawn from a generator of this seed: every rank builds the whole
# adapter before FSDP2 keeps its own shard of it, so all ranks must draw the same A (and a run
# then starts from the same adapter whatever its world size).
INIT_SEED = 0


def adapter_config(lora: LoraConfig, base_model: str | Path) -> dict | None:
    """The adapter's peft config, as a peft adapter folder's adapter_config.json holds it (what
    vLLM builds a LoRA from); None when LoRA is off. `base_model`: the base model's folder."""
    return lora.spec.peft_config(base_model) if lora.enabled else None


def add_adapter(model: nn.Module, adapter: dict) -> None:
    """Injects the fresh adapter `adapter` (an `adapter_config`) into `model` in place, before it
    is sharded, and freezes everything else."""
    import peft

    config = peft.LoraConfig(**{key: value for key, value in adapter.items() if key != "peft_type"})
    with torch.random.fork_rng(devices=[]):  # peft draws A on the CPU, where the model is built
        torch.manual_seed(INIT_SEED)
        model.add_adapter(config, adapter_name=PEFT_ADAPTER)


def base_key(name: str) -> str:
    """The plain Hugging Face name of a base parameter (`...q_proj.base_layer.weight` ->
    `...q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def has_adapter(model: nn.Module) -> bool:
    return any(adapter_key(name) for name, _ in model.named_parameters())


def adapter_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapter's parameters, in registration order, under `adapter_key` names."""
    return [(key, param) for name, param in model.named_parameters() if (key := adapter_key(name))]


def base_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every parameter but the adapter's (tied ones once), under plain Hugging Face names: the
    base model's weights."""
    return [(base_key(name), param) for name, param in model.named_parameters() if not adapter_key(name)]


def merge(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base weights with the adapter merged in (W + scale B A), under plain Hugging Face names:
    a model without the adapter computes with them what `model` computes with it. Merges
    `model`'s adapter layers in place: train or score nothing with it afterwards."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge(safe_merge=True)  # refuses to merge in a weight that is not finite
        return [(key, param.detach()) for key, param in base_params(model)]
