"""The weight transports by name: the one registry line per transport, and the spec each one
exports. `TRANSPORTS` maps a name to its package (`fleetrl.weights.<name>`), whose `SPEC` is
imported only when that name is used, so the config can check a name, and a worker rank load a
receiver, without importing any sender (the trainer's side, which reaches the coordinator).
The config's `inference.weights.transport`, the wire parser (weights/wire.py), `make_transport`
(weights/factory.py) and a worker rank's update (engine/weight_update.py) all read it here.
A leaf: it imports nothing of fleetrl, so that the config, low in the layers, may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# name -> the package that exports its SPEC. Adding a transport: its package, and a line here.
TRANSPORTS = {
    "broadcast": "fleetrl.weights.broadcast",
    "filesystem": "fleetrl.weights.filesystem",
    "shm": "fleetrl.weights.shm",
}


@dataclass(frozen=True)
class SenderSettings:
    """What `inference.weights` gives every sender; each transport uses what it needs."""

    host: str  # the address workers reach the trainer at
    bucket_bytes: int  # a broadcast's bucket, or a filesystem shard
    storage_dir: Path  # where a transport that stores versions keeps them
    timeout_s: float  # each step on a worker (join, one bucket, a whole load)
    backend: str  # the broadcast group's (weights/broadcast/group.py)
    target: str  # what the tensors replace on the workers (weights/target.py)


class Receiver(Protocol):
    """A transport's side in one worker rank, as engine/weight_receiver.py drives it."""

    @classmethod
    def join(cls, init: Any, worker_rank: int) -> Receiver:
        """Ready for the updates `init` (the transport's init record) announces; `worker_rank`
        is this rank's place among its worker's ranks."""

    def receive(self, update: Any) -> Iterator[list[tuple[str, Any]]]:
        """The tensors of one update record, in batches: each batch is hashed and loaded as it
        comes, and producing it is the time spent receiving."""

    def reset_on_failure(self) -> None:
        """After a failed update: drop what the sender must set up again."""

    @property
    def state(self) -> str:
        """What the sender checks a rank holds (a broadcast group's name); "" for nothing."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class TransportSpec:
    """One transport: its wire records, and its two sides as "module:Class" paths, imported
    only by the process that runs that side."""

    name: str
    init: type  # the init record: a strict record (fleetrl/strict.py) with `transport` and `target`
    update: type  # the update record
    sender: str  # a class with `from_settings(SenderSettings)`: the provider seam's WeightTransport
    receiver: str  # a class following `Receiver`

    def sender_class(self) -> Any:
        return _load(self.sender)

    def receiver_class(self) -> type[Receiver]:
        return _load(self.receiver)


def spec(name: str) -> TransportSpec:
    """The spec of transport `name`; a ValueError naming the known ones if there is none."""
    check_name(name, "weight transport")
    return importlib.import_module(TRANSPORTS[name]).SPEC


def check_name(name: object, what: str) -> None:
    if not isinstance(name, str) or name not in TRANSPORTS:
        raise ValueError(f"{what}: {name!r} is not one of {', '.join(TRANSPORTS)}")


def _load(path: str) -> Any:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
