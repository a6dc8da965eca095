"""The GPU weight path of a publish: full tensors gathered from the ranks' FSDP2 shards one at
a time, while rank 0 sends them, instead of a full CPU snapshot of the model. Rank 0 leads a
session (`WeightGather`) for the length of one publish, broadcasting the index of each parameter
it wants; every other rank follows in `serve_gathers` until `STOP`. The protocol, its retries and
why late workers wait for the next publish: docs/architecture.md, "The GPU weight path". Unit-tested
on two gloo ranks on the CPU only: docs/benchmarks.md, "GPU smoke: not run yet"."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fleetrl.trainer.distributed import World
from fleetrl.trainer.model import published_params

STOP = -1


class WeightGather:
    """Rank 0's side of a gather session (a context manager: leaving it lets the peers go)."""

    def __init__(self, model: nn.Module, world: World) -> None:
        if world.rank != 0:
            raise ValueError("only rank 0 leads a weight gather; the other ranks serve it (serve_gathers)")
        self.world = world
        self.params = published_params(model)  # as named_tensors: tied weights once; the adapter alone with LoRA
        self._open = True

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter as a full tensor, in `named_tensors` order, each gathered when it is
        pulled; drop each before pulling the next. May be called again (a retry) while open."""
        for index, (name, param) in enumerate(self.params):
            if not self._open:
                raise RuntimeError("weight gather: the session is closed; the ranks gather only during a publish")
            yield name, self._gather(index, param)

    def _gather(self, index: int, param: nn.Parameter) -> torch.Tensor:
        with _on_device(self.world.device):
            if self.world.world_size > 1:
                _command(index, self.world.device)
            return full_tensor(param)

    def close(self) -> None:
        if self._open:
            self._open = False
            if self.world.world_size > 1:
                with _on_device(self.world.device):
                    _command(STOP, self.world.device)

    def __enter__(self) -> WeightGather:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve_gathers(model: nn.Module, world: World) -> None:
    """A rank other than 0: takes part in every gather rank 0 leads, until it stops the session."""
    params = [param for _, param in published_params(model)]
    while (index := _command(None, world.device)) != STOP:
        full_tensor(params[index])  # rank 0's to send; this rank's copy is dropped at once


def full_tensor(param: nn.Parameter) -> torch.Tensor:
    """The whole parameter (a collective on a sharded one), detached."""
    with torch.no_grad():
        tensor = param.detach()
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _command(index: int | None, device: torch.device) -> int:
    """Rank 0 sends `index`; every other rank passes None and gets it."""
    message = torch.tensor([STOP if index is None else index], dtype=torch.int64, device=device)
    dist.broadcast(message, src=0)
    return int(message.item())


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    # Rank 0 pulls the stream on the fleet's control thread (its sender's workers) while the
    # training thread waits in the publish hook, so one thread at a time issues collectives; the
    # CUDA device is a per-thread setting, so each gather sets it.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
