"""The wire schema of a weight transfer: what the sender (broadcast/sender.py, filesystem/sender.py) posts
to each worker, and what fleetrl's weight receiver reads in every rank of it
(engine/weight_receiver.py). Both sides import these types; neither spells a key by hand.

They travel as JSON objects through vLLM's weight-transfer protocol (native servers) or
Dynamo's RL routes:

    init_info    InitInfo      /init_weight_transfer_engine: which transport; for the
                               broadcast, the sender's rendezvous and this worker's ranks
    update_info  BucketInfo    /update_weights, broadcast: the tensors of one bucket
                 ManifestInfo  /update_weights, filesystem: a whole published version

No vLLM here: the sender runs in the trainer, which has none.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

from fleetrl.weights.buckets import TensorMeta

TransportKind = Literal["broadcast", "filesystem"]
TRANSPORTS = get_args(TransportKind)


def _from_dict(cls, data: dict[str, Any], what: str):
    try:
        return cls(**data)
    except TypeError as e:  # a missing or an unknown key
        raise ValueError(f"{what}: {e}") from None


@dataclass(frozen=True)
class InitInfo:
    transport: TransportKind
    # broadcast only: the sender's rendezvous and this worker's place in the group
    master_address: str = ""
    master_port: int = 0
    group_name: str = ""
    backend: str = "gloo"  # the sender's choice: "nccl" when its tensors are on CUDA
    rank_offset: int = 0  # the group rank of this worker's first rank
    world_size: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"init_info.transport: {self.transport!r} is not one of {TRANSPORTS}")
        if self.transport == "broadcast" and not (self.master_address and self.master_port
                                                  and self.group_name and self.world_size > 1):
            raise ValueError("init_info: the broadcast transport needs master_address, master_port, "
                             "group_name and world_size > 1")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"init_info.backend: {self.backend!r} is not gloo or nccl")

    def to_dict(self) -> dict[str, Any]:
        """The filesystem transport needs nothing but its name, and sends nothing else."""
        if self.transport == "filesystem":
            return {"transport": self.transport}
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InitInfo:
        return _from_dict(cls, data, "init_info")


@dataclass(frozen=True)
class BucketInfo:
    """One broadcast bucket: the tensors packed in it, in order (buckets.py computes the
    offsets from these, so only they travel beside the bytes)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @classmethod
    def of(cls, metas: list[TensorMeta]) -> BucketInfo:
        return cls([m.name for m in metas], [m.dtype for m in metas], [list(m.shape) for m in metas])

    def metas(self) -> list[TensorMeta]:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"update_info: {len(self.names)} names, {len(self.dtypes)} dtypes and "
                             f"{len(self.shapes)} shapes")
        return [TensorMeta(n, d, tuple(s)) for n, d, s in zip(self.names, self.dtypes, self.shapes)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BucketInfo:
        return _from_dict(cls, data, "update_info for the fleetrl broadcast transport")


@dataclass(frozen=True)
class ManifestInfo:
    """A whole version on shared storage: the path of its manifest.json, as every worker sees it."""

    manifest: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ManifestInfo:
        return _from_dict(cls, data, "update_info for the fleetrl filesystem transport")
