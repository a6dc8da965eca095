"""Broadcast transport, receiver side: one worker rank in the trainer's broadcast group.

It joins the group an init names and takes each bucket's bytes as the sender broadcasts them.
No vLLM here: fleetrl's weight-transfer backend (engine/weight_receiver.py) drives it in every
rank, and hashes and loads what it returns.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fleetrl.weights.broadcast import group as broadcast_group
from fleetrl.weights.broadcast.wire import BroadcastInit, BucketInfo
from fleetrl.weights.buckets import layout, unpack_bucket


class BroadcastReceiver:
    def __init__(self, group: broadcast_group.BroadcastGroup) -> None:
        self._group: broadcast_group.BroadcastGroup | None = group  # None once dropped

    @classmethod
    def join(cls, init: BroadcastInit, worker_rank: int) -> BroadcastReceiver:
        """Blocks until the whole group has formed, the sender included. `worker_rank`: this
        rank's place among its worker's ranks; its group rank is init.rank_offset + worker_rank."""
        store = broadcast_group.connect_store(init.master_address, init.master_port, init.world_size,
                                              init.timeout_s)
        return cls(broadcast_group.join(store, init.group_name, init.rank_offset + worker_rank, init.world_size,
                                        init.backend, init.timeout_s))

    @property
    def state(self) -> str:
        """The name of the group this rank is in; "" once it was dropped."""
        return self._group.name if self._group is not None else ""

    def receive(self, bucket: BucketInfo) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The bucket's tensors, once its bytes are in: views into a buffer of its own."""
        if self._group is None:
            raise RuntimeError("broadcast receiver: the group was dropped after a failure; the sender forms a new one")
        metas = bucket.metas()
        _, total = layout(metas)
        # A fresh buffer per bucket, never a reused one: the layerwise reload keeps the
        # loaded views until their layer is complete, which may be in the next bucket.
        buffer = torch.empty(total, dtype=torch.uint8, device=broadcast_group.buffer_device(self._group.backend_name))
        self._group.broadcast(buffer)
        yield unpack_bucket(buffer, metas)

    def reset_on_failure(self) -> None:
        """A group that failed a broadcast is broken: dropped, and re-formed by the sender."""
        self.close()

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
