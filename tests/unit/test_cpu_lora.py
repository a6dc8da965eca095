"""fleetrl's per-adapter LoRA products against vLLM's CPU ops they replace (engine/cpu_lora.py)."""

from __future__ import annotations

import pytest
import torch
from vllm.lora.ops.torch_ops import lora_ops as vllm_ops

from fleetrl.engine.cpu_lora import _replacements

OURS = _replacements({name: getattr(vllm_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")})
# one adapter (a fleetrl run), two, and vLLM's -1 index beside one
INDICES = [[0] * 7, [0, 1, 1, 0, 1, 0, 0], [-1, 0, 0, -1, 0, 0, 0]]


@pytest.mark.parametrize("indices", INDICES)
def test_shrink_matches_vllm(indices):
    torch.manual_seed(0)
    inputs, weights, indices = torch.randn(7, 24), torch.randn(3, 1, 4, 24), torch.tensor(indices)
    theirs, ours = torch.zeros(7, 4), torch.zeros(7, 4)
    vllm_ops.bgmv_shrink(inputs, weights, theirs, indices, 0.5)
    OURS["bgmv_shrink"](inputs, weights, ours, indices, 0.5)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("indices", INDICES)
@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_matches_vllm_with_padded_outputs(indices, add_inputs):
    torch.manual_seed(1)
    inputs, weights, indices = torch.randn(7, 4), torch.randn(3, 1, 20, 4), torch.tensor(indices)
    start = torch.randn(7, 18)  # an output narrower than the adapter's (padding differs)
    theirs, ours = start.clone(), start.clone()
    vllm_ops.bgmv_expand(inputs, weights, theirs, indices, add_inputs)
    OURS["bgmv_expand"](inputs, weights, ours, indices, add_inputs)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("indices", INDICES)
@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_slice_matches_vllm(indices, add_inputs):
    torch.manual_seed(2)
    inputs, weights, indices = torch.randn(7, 4), torch.randn(3, 6, 4), torch.tensor(indices)
    start = torch.randn(7, 16)
    theirs, ours = start.clone(), start.clone()
    vllm_ops.bgmv_expand_slice(inputs, weights, theirs, indices, 5, 6, add_inputs)
    OURS["bgmv_expand_slice"](inputs, weights, ours, indices, 5, 6, add_inputs)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours[:, :5], start[:, :5])  # outside the slice, nothing moved


def test_an_index_per_batch_not_per_row_goes_to_vllms_own_op():
    inputs, weights = torch.randn(1, 4), torch.randn(2, 1, 5, 4)
    theirs, ours = torch.zeros(1, 5), torch.zeros(1, 5)
    vllm_ops.bgmv_expand(inputs, weights, theirs, torch.tensor([1, 1]), False)
    OURS["bgmv_expand"](inputs, weights, ours, torch.tensor([1, 1]), False)
    torch.testing.assert_close(ours, theirs)
