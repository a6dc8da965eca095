"""What the fleet coordinator calls to move a policy version onto workers.

A transport runs the weight part of publish(v) on workers the coordinator has already
paused, through each worker's admin client (`WorkerAdmin`): (join if needed) ->
start_weight_update -> update_weights ... -> finish_weight_update(v). The admin client maps
these onto the worker kind's routes (vLLM's weight-transfer protocol, or Dynamo's RL routes
naming the same engine methods); on the worker, fleetrl's `fleetrl` weight-transfer backend
receives them in every rank. The transport returns fleetrl's checksum of what it sent; the
coordinator then has every worker check that each of its ranks received exactly that.

If a transfer fails, no worker is left with an update open, every worker of the call is
labelled `incomplete-v{version}` (a label that names no policy version), and the error
names a worker; the coordinator treats those workers as stale until a full
transfer succeeds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from fleetrl.weights.broadcast import BroadcastTransport
from fleetrl.weights.filesystem import FilesystemTransport

if TYPE_CHECKING:
    from fleetrl.inference.provider import WorkerAdmin

# Called once per transfer; yields every full (unsharded) tensor of the policy, in a stable
# order, under the names the model's checkpoint uses. For a sharded trainer the iteration
# may be a collective (FSDP full_tensor()).
NamedTensors = Callable[[], Iterable[tuple[str, torch.Tensor]]]
TransportKind = Literal["broadcast", "filesystem"]


class WeightTransport(Protocol):
    name: str

    async def transfer(self, workers: Sequence[WorkerAdmin], named_tensors: NamedTensors,
                       version: int) -> str:
        """Moves the weights onto already-paused workers as policy `version`; returns the
        sender-side checksum."""
        ...

    async def close(self) -> None: ...


def make_transport(kind: TransportKind, *, host: str, bucket_bytes: int, storage_dir: Path,
                   timeout_s: float = 600.0) -> WeightTransport:
    """`bucket_bytes` is the broadcast bucket, or the filesystem shard size. `timeout_s`
    bounds each step on a worker (join, one bucket, a whole filesystem load)."""
    if kind == "broadcast":
        return BroadcastTransport(host, bucket_bytes, timeout_s)
    if kind == "filesystem":
        return FilesystemTransport(storage_dir, bucket_bytes, timeout_s)
    raise ValueError(f"weight transport {kind!r} is not one of broadcast, filesystem")
