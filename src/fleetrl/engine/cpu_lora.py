"""vLLM's CPU LoRA products computed with one matrix multiply per adapter, in every worker.

vLLM's CPU build applies LoRA through plain-torch "punica" ops (`vllm.lora.ops.torch_ops`).
Each of them gathers every token's adapter matrix into a [tokens, out, in] copy and multiplies
token by token (an einsum). A prefill of 2,048 tokens copies each matrix 2,048 times, in every
adapted layer: sampling through an adapter ran 12x slower than without one on this machine
(docs/benchmarks.md). A fleetrl run has one adapter, so the batch needs one product per
adapter present: `per_adapter_products` below, 30-70x faster per call at prefill sizes
(benchmarks/bench_cpu_lora.py).

Only the three bgmv ops are replaced; vLLM's sgmv ops call them through their module's
globals. What they compute is kept exactly: token t times `weights[indices[t]]` (vLLM's
indexing, -1 included), written into the output as vLLM writes it. A batch whose index count
is not one per input row goes to vLLM's own op.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# The vLLM whose op signatures these replace; another version keeps its own ops.
REPLACES_OPS_OF_VLLM = "0.32.0"


def per_adapter_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """[tokens, in] x stacked [adapters, (1,) out, in] -> [tokens, out]: each token times the
    matrix its index names, one matmul per distinct index."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    adapters = indices.unique()
    if adapters.numel() == 1:
        return inputs @ weights[adapters[0]].to(dtype).T
    products = inputs.new_empty(inputs.shape[0], weights.shape[1])
    for adapter in adapters.tolist():
        rows = indices == adapter
        products[rows] = inputs[rows] @ weights[adapter].to(dtype).T
    return products


def _write(target: torch.Tensor, values: torch.Tensor, add: bool) -> None:
    if add:
        target += values
    else:
        target[...] = values


def _replacements(vllm_ops: dict):
    def bgmv_shrink(inputs, weights, output, indices, scaling=1.0):
        if indices.shape[0] != inputs.shape[0]:
            return vllm_ops["bgmv_shrink"](inputs, weights, output, indices, scaling)
        products = per_adapter_products(inputs, weights, indices, output.dtype)
        output[:, :products.shape[1]] = scaling * products

    def bgmv_expand(inputs, weights, output, indices, add_inputs=True):
        if indices.shape[0] != inputs.shape[0]:
            return vllm_ops["bgmv_expand"](inputs, weights, output, indices, add_inputs)
        products = per_adapter_products(inputs, weights, indices, output.dtype)
        common = min(products.shape[1], output.shape[1])  # the two may pad differently
        _write(output[:, :common], products[:output.shape[0], :common], add_inputs)

    def bgmv_expand_slice(inputs, weights, output, indices, slice_offset, slice_size, add_inputs=True):
        if indices.shape[0] != inputs.shape[0]:
            return vllm_ops["bgmv_expand_slice"](inputs, weights, output, indices, slice_offset, slice_size,
                                              add_inputs)
        products = per_adapter_products(inputs, weights, indices, output.dtype)
        _write(output[:, slice_offset:slice_offset + slice_size], products, add_inputs)

    return {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def use_per_adapter_products() -> None:
    """Puts the replacements where vLLM's CPU LoRA looks its ops up; on a vLLM they were not
    written against, vLLM's own ops are kept (and a warning logged)."""
    import vllm

    if vllm.__version__.split("+", 1)[0] != REPLACES_OPS_OF_VLLM:
        log.warning("fleetrl: vLLM %s keeps its own CPU LoRA ops (fleetrl's replace those of %s)",
                    vllm.__version__, REPLACES_OPS_OF_VLLM)
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops.bgmv_shrink, "__module__", "") == __name__:
        return  # this process already has them
    vllm_ops = {name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}
    for name, op in _replacements(vllm_ops).items():
        setattr(lora_ops, name, op)
        setattr(punica_cpu, name, op)
