"""The GPU weight path of a publish: full tensors gathered from the ranks' FSDP2 shards one at
a time, while rank 0 sends them, instead of a full CPU snapshot of the model.

On CUDA the trainer keeps no copy of a published version. Rank 0 opens a `WeightGather` for the
duration of one publish and hands it to the publish hook; the sender pulls `tensors()` and packs
each tensor into its bucket as it comes (`weights.buckets.packed_buckets`), so the GPU holds one
bucket and the tensor in hand beyond the shards. Every other rank runs `serve_gathers` for that
same time: gathering a sharded tensor is a collective of the trainer's group, and only rank 0
knows when the fleet asks for the weights, so rank 0 leads and the others follow.

The protocol, over the trainer's default group: before each gather rank 0 broadcasts the index
of the parameter it wants (in `model.published_params` order), and every rank then gathers that one
parameter; `STOP` ends the session. The peers follow whatever rank 0 asks, so rank 0 may stop a
stream half way (a transfer failed) and start it again from the first tensor (the fleet retries
it) without the peers' knowing: no collective is left half done.

The stream is valid only while the session is open: afterwards the peers train on, and the
parameters are no longer the published version. Hence the fleet keeps no refit source for a
version published this way; a worker that joins or goes stale between publishes waits, out of
routing, for the next publish (docs/architecture.md, "The GPU weight path").

Threads: rank 0 pulls the stream on the fleet's control thread (its sender's worker threads)
while the training thread waits in the publish hook, so only one thread issues collectives at
a time. The CUDA device is a per-thread setting: each gather sets it.

Status: these gathers over two gloo ranks are unit-tested on the CPU; on CUDA (NCCL, FSDP2 with
bf16 compute) they were never run here (docs/benchmarks.md, "GPU smoke: not run yet").
"""

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
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
