"""Broadcast transport, sender side: the trainer is rank 0 of a group with every rank of
every worker, and sends the weights bucket by bucket (gloo over TCP when its tensors are on
the CPU, NCCL when they are on CUDA).

Per bucket the sender posts the bucket's metadata to every worker (update_weights blocks
in the worker until the bytes arrive) while it broadcasts the bytes from a thread. The group
lives across publishes and is re-formed when the worker set changes, when any worker rank is
not in it (a worker restarted) or after a failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid
from collections.abc import Iterable, Sequence

import torch

from fleetrl import failpoints
from fleetrl.inference.provider import NamedTensors, WorkerAdmin
from fleetrl.weights import fanout
from fleetrl.weights import group as broadcast_group
from fleetrl.weights.buckets import iter_buckets, pack_bucket
from fleetrl.weights.checksum import WeightsHasher
from fleetrl.weights.wire import BucketInfo, InitInfo

JOIN_POLL_S = 0.05


class BroadcastTransport:
    name = "broadcast"

    def __init__(self, host: str, bucket_bytes: int, timeout_s: float) -> None:
        self.host = host  # the address workers reach the trainer at
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._group: broadcast_group.BroadcastGroup | None = None

    async def transfer(self, workers: Sequence[WorkerAdmin], named_tensors: NamedTensors,
                       version: int) -> str:
        tensors = iter(named_tensors())
        first = next(tensors, None)
        if first is None:
            raise fanout.WeightTransferError("broadcast transport: no tensors to send")
        backend = broadcast_group.backend_for(first[1].device)
        try:
            await self._ensure_group(workers, backend)
        except BaseException:
            self._drop_group()
            raise
        try:
            await fanout.on_all(workers, lambda w: w.start_weight_update(self.timeout_s))
            checksum = await self._send(workers, itertools.chain([first], tensors))
            await failpoints.held("publish", version)  # every bucket in, the update still open
            await fanout.on_all(workers, lambda w: w.finish_weight_update(version, self.timeout_s))
        except BaseException:
            self._drop_group()
            await fanout.abandon_update(workers, version)
            raise
        return checksum

    async def close(self) -> None:
        self._drop_group()

    # -- group ------------------------------------------------------------------------------

    async def _ensure_group(self, workers: Sequence[WorkerAdmin], backend: broadcast_group.Backend) -> None:
        current = self._group
        membership = await fanout.on_all(workers, lambda w: w.broadcast_membership(current.name if current else ""))
        ranks = [count for count, _ in membership]
        if (current is not None and current.backend_name == backend
                and current.world_size == 1 + sum(ranks) and all(joined for _, joined in membership)):
            return
        self._drop_group()
        self._group = await self._form_group(workers, ranks, backend)

    async def _form_group(self, workers: Sequence[WorkerAdmin], ranks: list[int],
                          backend: broadcast_group.Backend) -> broadcast_group.BroadcastGroup:
        world_size = 1 + sum(ranks)
        name = uuid.uuid4().hex[:12]
        store = broadcast_group.open_store(self.host, world_size, self.timeout_s)
        init_info = InitInfo("broadcast", master_address=self.host, master_port=store.port, group_name=name,
                             backend=backend, world_size=world_size, timeout_s=self.timeout_s)
        # Each call returns only once the whole group has formed, the sender included.
        inits = [
            asyncio.ensure_future(worker.init_weight_transfer(
                dataclasses.replace(init_info, rank_offset=offset).to_dict(), self.timeout_s))
            for worker, offset in zip(workers, itertools.accumulate([1, *ranks[:-1]]))
        ]
        try:
            await self._wait_for_ranks(store, name, world_size - 1, inits)
            group = await asyncio.to_thread(
                broadcast_group.join, store, name, 0, world_size, backend, self.timeout_s)
        except BaseException:
            # Dropping the (only reference to the) store shuts its server down: worker ranks
            # still waiting to join fail at once instead of waiting out the timeout.
            del store
            await asyncio.gather(*inits, return_exceptions=True)
            raise
        await asyncio.gather(*inits)
        return group

    async def _wait_for_ranks(self, store, name: str, expected: int, inits: list[asyncio.Future]) -> None:
        """Waits until `expected` worker ranks are joining; the sender's own join blocks a
        thread that cannot be called off, so it starts only then. Fails at once if an init
        call fails (a worker that will never join)."""
        deadline = time.monotonic() + self.timeout_s
        while (count := broadcast_group.arrived(store, name)) < expected:
            for init in inits:
                if init.done() and init.exception() is not None:
                    raise init.exception()
            if time.monotonic() > deadline:
                raise fanout.WeightTransferError(
                    f"broadcast group: {count} of {expected} worker ranks joined within {self.timeout_s:.0f} s")
            await asyncio.sleep(JOIN_POLL_S)

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    # -- send -------------------------------------------------------------------------------

    async def _send(self, workers: Sequence[WorkerAdmin],
                    tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        assert self._group is not None
        group = self._group
        device = broadcast_group.buffer_device(group.backend_name)
        hasher = WeightsHasher()
        for bucket in iter_buckets(tensors, self.bucket_bytes):
            buffer, metas = await asyncio.to_thread(pack_bucket, bucket, device)
            update_info = BucketInfo.of(metas).to_dict()
            await fanout.run_together(
                *(w.update_weights(update_info, self.timeout_s) for w in workers),
                asyncio.to_thread(group.broadcast, buffer),
                # Hashing overlaps the broadcast (hashlib releases the GIL).
                asyncio.to_thread(hasher.update_all, bucket),
                on_failure=group.close,
            )
        return hasher.hexdigest()
