"""The broadcast transport's wire records, in the envelope of weights/wire.py:

    init_info    BroadcastInit  the sender's rendezvous and this worker's place in the group
    update_info  BucketInfo     the tensors of one bucket, whose bytes follow by broadcast
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import model_validator

from fleetrl.strict import Strict
from fleetrl.weights.buckets import TensorMeta
from fleetrl.weights.target import UpdateTarget


class BroadcastInit(Strict):
    transport: ClassVar[str] = "broadcast"

    master_address: str = ""
    master_port: int = 0
    group_name: str = ""
    backend: str = "gloo"  # the sender's choice: "nccl" when its tensors are on CUDA
    rank_offset: int = 0  # the group rank of this worker's first rank
    world_size: int = 0
    timeout_s: float = 300.0
    target: UpdateTarget = "model"

    @model_validator(mode="after")
    def _joinable(self) -> BroadcastInit:
        # Defaults rather than required fields, so that a missing key is refused by this one
        # message, which names everything the receiver needs.
        if not (self.master_address and self.master_port and self.group_name and self.world_size > 1):
            raise ValueError("the broadcast transport needs master_address, master_port, group_name and "
                             "world_size > 1")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: {self.backend!r} is not gloo or nccl")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"transport": self.transport, **super().to_dict()}


class BucketInfo(Strict):
    """One broadcast bucket: the tensors packed in it, in order (buckets.py computes the
    offsets from these, so only they travel beside the bytes)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @classmethod
    def of(cls, metas: list[TensorMeta]) -> BucketInfo:
        return cls(names=[m.name for m in metas], dtypes=[m.dtype for m in metas],
                   shapes=[list(m.shape) for m in metas])

    def metas(self) -> list[TensorMeta]:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"update_info: {len(self.names)} names, {len(self.dtypes)} dtypes and "
                             f"{len(self.shapes)} shapes")
        return [TensorMeta(n, d, tuple(s)) for n, d, s in zip(self.names, self.dtypes, self.shapes)]
