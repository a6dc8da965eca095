"""The policy as the trainer holds it: a transformers causal LM (with a LoRA adapter when
`trainer.lora` is on: trainer/lora.py), sharded with FSDP2 when the trainer has several ranks,
the iteration over its weights that a publish sends (the adapter's alone with LoRA), and the
check that weights are finite before they are published or checkpointed.

Precision: the trainer keeps fp32 master weights, gradients and AdamW state everywhere. RL
learning rates are tiny (1e-6 is common) and a bf16 weight cannot absorb an update that much
smaller than itself, so bf16 *storage* would silently drop most updates. On CUDA the compute is
bf16 (FSDP2's MixedPrecisionPolicy gathers bf16 copies of the parameters and reduces gradients
in fp32; a single rank uses autocast), and the step turns logits into logprobs in fp32 because
the importance ratio is a difference of two logprobs. On CPU everything is fp32: CPUs without
native bf16 are several times slower in it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fleetrl.trainer.lora import adapter_params, add_adapter, has_adapter


# One model load at a time in a process: while transformers loads a model it patches module
# creation for the whole process (parameters are made on the meta device, then filled from the
# files), so a model built on another thread meanwhile comes out empty ("Cannot copy out of meta
# tensor"). fleetrl rl loads once (the trainer's copy also gives attached workers their base
# weights); the lock keeps any other pair of loads from overlapping.
_loading = threading.Lock()


def load_policy(path: Path, device: torch.device, sharded: bool = True, adapter: dict | None = None) -> nn.Module:
    """The HF model in `path`, fp32 on `device`, in train mode; sharded when the default
    process group has several ranks (every rank must call this), unless `sharded` is False: a
    whole copy in this process alone (`fleetrl inference`'s base weights of attached workers).
    `adapter`: a LoRA adapter's config (`lora.adapter_config`), added fresh before sharding, so
    that only it trains."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # fleetrl prints its own progress, a line per step
    with _loading:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False  # a training forward never reuses a KV cache
    if adapter is not None:
        add_adapter(model, adapter)
    model.to(device)
    if sharded and dist.is_initialized() and dist.get_world_size() > 1:
        shard(model, device)
    model.train()
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder layer list at base_model.layers to shard")
    return layers


def shard(model: nn.Module, device: torch.device) -> None:
    """FSDP2 over every rank of the default group: one unit per decoder layer (so only one
    layer's full weights exist at a time), and the root for the rest (embeddings, final norm,
    head; tied embeddings stay together in the root)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # The loss is already normalized by the whole batch's token count (see loss.py), so the
    # ranks' gradients must be summed, not averaged as FSDP does by default. A plain SUM
    # reduction: gloo has no PREMUL_SUM, which FSDP would otherwise use for a custom factor.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def compute_precision(model: nn.Module, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for an unsharded model on CUDA; FSDP2 already casts a sharded one."""
    if device.type == "cuda" and not is_sharded(model):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def published_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a publish sends, under the names the workers load them by: with LoRA the
    adapter's alone (`lora.adapter_params`), else every parameter once (tied weights under their
    first name) with HF names; in registration order, the same on every rank."""
    return adapter_params(model) if has_adapter(model) else list(model.named_parameters())


def named_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The published parameters (`published_params`) as full tensors, cast to `dtype` if given
    (what the workers serve).

    On a sharded model each step gathers one full tensor from every rank: all ranks must
    iterate to the end, in step; only rank 0 has a use for the result.
    """
    for name, param in published_params(model):
        # Detached, so no grad mode is needed: a `torch.no_grad()` held across the yield would
        # leak into the caller, and two of these iterated side by side would leave grad mode off.
        tensor = param.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor if dtype is None else tensor.to(dtype)


def local_shards(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The part of every published parameter (`published_params`) that this rank holds (all of
    it on an unsharded model): no collective, unlike `named_tensors`."""
    for name, param in published_params(model):
        tensor = param.detach()
        yield name, tensor.to_local() if isinstance(tensor, DTensor) else tensor


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]], across_ranks: bool = False) -> str | None:
    """The name of the first tensor holding a nan or an inf, or None; one device sync for all.

    `across_ranks`: the tensors are this rank's shards of the same names on every rank, and
    every rank must call this; a tensor bad on any rank is reported by all.
    """
    names, bad = [], []
    for name, tensor in named:
        names.append(name)
        bad.append(torch.isfinite(tensor).all().logical_not())
    if not names:
        return None
    flags = torch.stack(bad).int()  # not every backend reduces bool
    if across_ranks and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags)
    hits = flags.nonzero()
    return names[hits[0].item()] if len(hits) else None


def agreement_probe(model: nn.Module, length: int = 24) -> list[int]:
    """The token ids of the agreement probe: after every step the trainer scores them, and after
    every publish each worker does too; a worker whose logprobs differ serves other weights than
    it was sent, whatever the checksum of the bytes it received says (an install bug, say).

    Ids spread over the vocabulary (a prime stride), not a text: every rank computes them from
    the model alone, with no tokenizer; the logits of every position cover the whole output
    layer (the tied embedding included) anyway.
    """
    vocab = model.config.vocab_size
    return [(i * 7919) % vocab for i in range(1, length + 1)]


@torch.no_grad()
def prompt_logprobs(model: nn.Module, token_ids: list[int], device: torch.device) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1 under the model in eval mode, as the workers serve
    it (a model with dropout would score at random in train mode); on a sharded model every rank
    must call this, in step (the forward is a collective)."""
    ids = torch.tensor([token_ids], device=device)
    training = model.training
    model.eval()
    try:
        with compute_precision(model, device):
            logits = model(input_ids=ids).logits[0, :-1].float()
    finally:
        model.train(training)
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()
