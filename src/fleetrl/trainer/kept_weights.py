"""A copy of this rank's share of the published parameters (`model.local_shards`: all of them, or
with LoRA the adapter's alone, a few MiB, since the base never changes), swapped into the model
for a no-grad forward:
the tokens of a step scored under other weights than the ones being trained, with no second
model (which FSDP would have to shard and gather on its own). Two are kept:

- the previous version's, to score tokens sampled one version behind under their own version
  (`mismatch.py`), remembered right before each update;
- the reference model's, for the KL penalty (`trainer.loss.kl_coef`), remembered once from the base
  model as it loads, before any checkpoint: a resumed run keeps the same reference (with LoRA
  the fresh adapter, whose B = 0: the base model exactly).

Each costs one more copy of the rank's share of the parameters (fp32), and is kept only where
it is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from fleetrl.trainer.model import is_sharded, local_shards


class KeptWeights:
    def __init__(self) -> None:
        self.version: int | None = None  # the version the copy holds, once remembered
        self._tensors: list[torch.Tensor] = []

    def remember(self, model: nn.Module, version: int) -> None:
        """Keeps the model's weights now, which are `version`'s."""
        with torch.no_grad():
            shards = [tensor for _, tensor in local_shards(model)]
            if not self._tensors:
                self._tensors = [tensor.clone() for tensor in shards]
            else:
                for kept, tensor in zip(self._tensors, shards, strict=True):
                    kept.copy_(tensor)
        self.version = version

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        """The model holds the kept weights inside the block, its own again after it; on a
        sharded model every rank must enter it, in step."""
        self._swap(model)
        try:
            yield
        finally:
            self._swap(model)

    def _swap(self, model: nn.Module) -> None:
        if is_sharded(model):
            # FSDP2 keeps the root's parameters gathered after a forward: sharded again, the next
            # forward gathers from the shards swapped here.
            model.reshard()
        with torch.no_grad():
            for kept, (_, tensor) in zip(self._tensors, local_shards(model), strict=True):
                held = tensor.clone()
                tensor.copy_(kept)
                kept.copy_(held)
