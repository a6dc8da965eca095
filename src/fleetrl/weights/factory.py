"""The weight transport the run asked for (`inference.weights.transport`), built for the fleet
coordinator, which drives it through the provider seam's `WeightTransport` protocol.

A transport moves a policy version onto workers through each worker's weight-sync client,
which maps its calls onto the worker kind's routes (vLLM's weight-transfer protocol, or
Dynamo's RL routes naming the same engine methods), and fleetrl's `fleetrl` weight-transfer
backend receives them in every rank (engine/weight_receiver.py, with the transport's
receiver).
"""

from __future__ import annotations

from pathlib import Path

from fleetrl.inference.provider import WeightTransport
from fleetrl.weights.broadcast.sender import BroadcastTransport
from fleetrl.weights.filesystem.sender import FilesystemTransport
from fleetrl.weights.broadcast.group import BackendSetting
from fleetrl.weights.target import UpdateTarget
from fleetrl.weights.wire import TransportKind


def make_transport(kind: TransportKind, *, host: str, bucket_bytes: int, storage_dir: Path,
                   timeout_s: float = 600.0, backend: BackendSetting = "auto",
                   target: UpdateTarget = "model") -> WeightTransport:
    """`bucket_bytes` is the broadcast bucket, or the filesystem shard size. `timeout_s`
    bounds each step on a worker (join, one bucket, a whole filesystem load). `backend` is the
    broadcast group's (`group.choose_backend`). `target`: what the tensors sent replace on the
    workers (weights/target.py)."""
    if kind == "broadcast":
        return BroadcastTransport(host, bucket_bytes, timeout_s, backend, target)
    if kind == "filesystem":
        return FilesystemTransport(storage_dir, bucket_bytes, timeout_s, target)
    raise ValueError(f"weight transport {kind!r} is not one of broadcast, filesystem")
