"""The broadcast transport's wire records, in the envelope of weights/wire.py:

    init_info    BroadcastInit  the sender's rendezvous and this worker's place in the group
    update_info  BucketInfo     the tensors of one bucket, whose bytes follow by broadcast
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from fleetrl.weights.buckets import TensorMeta
from fleetrl.weights.target import UpdateTarget, check_target


@dataclass(frozen=True)
class BroadcastInit:
    transport: ClassVar[str] = "broadcast"

    master_address: str = ""
    master_port: int = 0
    group_name: str = ""
    backend: str = "gloo"  # the sender's choice: "nccl" when its tensors are on CUDA
    rank_offset: int = 0  # the group rank of this worker's first rank
    world_size: int = 0
    timeout_s: float = 300.0
    target: UpdateTarget = "model"

    def __post_init__(self) -> None:
        # Defaults rather than required fields, so that a missing key is refused by this one
        # message, which names everything the receiver needs.
        if not (self.master_address and self.master_port and self.group_name and self.world_size > 1):
            raise ValueError("init_info: the broadcast transport needs master_address, master_port, "
                             "group_name and world_size > 1")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"init_info.backend: {self.backend!r} is not gloo or nccl")
        check_target(self.target)

    def to_dict(self) -> dict[str, Any]:
        return {"transport": self.transport, **dataclasses.asdict(self)}


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
