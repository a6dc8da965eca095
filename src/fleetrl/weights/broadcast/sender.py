"""Broadcast transport, sender side: the trainer is rank 0 of a group with every rank of
every worker, and sends the weights bucket by bucket (gloo over TCP when its tensors are on
the CPU, NCCL when they are on CUDA, unless `inference.weights.backend` says otherwise).

The tensors are pulled, packed and hashed off the event loop: on a CUDA trainer they are
gathered from the ranks' shards as they are pulled (`trainer.gather`), each one a collective
of the trainer's group. Each tensor is packed into its bucket as it comes, and the next bucket
is packed while one goes out, so the GPU holds two buckets (and the tensor in hand) beyond the
shards; the checksum is taken from the packed bucket, as the receiver takes it.

Why not vLLM's own NCCL weight-transfer engine (vllm/distributed/weight_transfer/nccl_engine.py)
on CUDA: its sender needs vLLM's PyNcclCommunicator in the trainer, which has no vLLM; its
receiver computes no checksum, so the fence could not prove what each rank holds; and it has
no gloo twin for CPU fleets. fleetrl's backend carries both backends through one protocol.

Never run on a GPU yet: the NCCL path (CUDA buckets, a broadcast to workers' GPUs) is written
but has not run (docs/benchmarks.md, "GPU smoke: not run yet"); gloo is what the tests run.

Per bucket the sender posts the bucket's metadata to every worker (update_weights blocks
in the worker until the bytes arrive) while it broadcasts the bytes from a thread. The group
lives across publishes and is re-formed when the worker set changes, when any worker rank is
not in it (a worker restarted) or after a failure.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Iterable, Sequence

import torch

from fleetrl import failpoints
from fleetrl.inference.provider import NamedTensors, WeightSyncClient
from fleetrl.transports import SenderSettings
from fleetrl.weights import fanout
from fleetrl.weights.broadcast import group as broadcast_group
from fleetrl.weights.buckets import packed_buckets, unpack_bucket
from fleetrl.weights.checksum import WeightsHasher
from fleetrl.weights.broadcast.wire import BroadcastInit, BucketInfo
from fleetrl.weights.target import UpdateTarget

JOIN_POLL_S = 0.05


class BroadcastTransport:
    name = "broadcast"

    def __init__(self, host: str, bucket_bytes: int, timeout_s: float,
                 backend: broadcast_group.BackendSetting = "auto", target: UpdateTarget = "model") -> None:
        broadcast_group.require_backend(backend)
        self.host = host  # the address workers reach the trainer at
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.backend = backend
        self.target = target
        self._group: broadcast_group.BroadcastGroup | None = None

    @classmethod
    def from_settings(cls, settings: SenderSettings) -> BroadcastTransport:
        return cls(settings.host, settings.bucket_bytes, settings.timeout_s, settings.backend, settings.target)

    async def transfer(self, workers: Sequence[WeightSyncClient], named_tensors: NamedTensors,
                       version: int) -> str:
        tensors = iter(named_tensors())
        first = await asyncio.to_thread(next, tensors, None)  # a gathered stream's first collective
        if first is None:
            raise fanout.WeightTransferError("broadcast transport: no tensors to send")
        backend = broadcast_group.choose_backend(self.backend, first[1].device)
        stream = itertools.chain([first], tensors)
        del first  # a gathered tensor lives only until it is packed
        try:
            await self._ensure_group(workers, backend)
        except BaseException:
            self._drop_group()
            raise
        try:
            await fanout.on_all(workers, lambda w: w.start(self.timeout_s))
            checksum = await self._send(workers, stream)
            await failpoints.held("publish", version)  # every bucket in, the update still open
            await fanout.on_all(workers, lambda w: w.finish(version, self.timeout_s))
        except BaseException:
            self._drop_group()
            await fanout.abandon_update(workers, version)
            raise
        return checksum

    async def close(self) -> None:
        self._drop_group()

    # -- group ------------------------------------------------------------------------------

    async def _ensure_group(self, workers: Sequence[WeightSyncClient], backend: broadcast_group.Backend) -> None:
        current = self._group
        membership = await fanout.on_all(workers, lambda w: w.membership(current.name if current else ""))
        ranks = [count for count, _ in membership]
        if (current is not None and current.backend_name == backend
                and current.world_size == 1 + sum(ranks) and all(joined for _, joined in membership)):
            return
        self._drop_group()
        self._group = await self._form_group(workers, ranks, backend)

    async def _form_group(self, workers: Sequence[WeightSyncClient], ranks: list[int],
                          backend: broadcast_group.Backend) -> broadcast_group.BroadcastGroup:
        world_size = 1 + sum(ranks)
        name = uuid.uuid4().hex[:12]
        store = broadcast_group.open_store(self.host, world_size, self.timeout_s)
        init_info = BroadcastInit(master_address=self.host, master_port=store.port, group_name=name,
                                  backend=backend, world_size=world_size, timeout_s=self.timeout_s,
                                  target=self.target)
        # Each call returns only once the whole group has formed, the sender included.
        inits = [
            asyncio.ensure_future(worker.init(
                init_info.model_copy(update={"rank_offset": offset}).to_dict(), self.timeout_s))
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

    async def _send(self, workers: Sequence[WeightSyncClient],
                    tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        assert self._group is not None
        group = self._group
        device = broadcast_group.buffer_device(group.backend_name)
        hasher = WeightsHasher()
        buckets = packed_buckets(tensors, self.bucket_bytes, device)
        packing = asyncio.ensure_future(asyncio.to_thread(next, buckets, None))
        try:
            while (packed := await packing) is not None:
                # The workers return once a bucket is in, and hash and load it on threads of
                # their own (engine/load_pipeline.py); so the next bucket is packed while this
                # one goes out, and on the wire while they load this one.
                packing = asyncio.ensure_future(asyncio.to_thread(next, buckets, None))
                buffer, metas = packed
                update_info = BucketInfo.of(metas).to_dict()
                await fanout.run_together(
                    *(w.update(update_info, self.timeout_s) for w in workers),
                    asyncio.to_thread(group.broadcast, buffer),
                    # Hashing overlaps the broadcast (hashlib releases the GIL); from the packed
                    # bytes, one device-to-host copy per bucket, as the receiver hashes them.
                    asyncio.to_thread(_hash_bucket, hasher, buffer, metas),
                    on_failure=group.close,
                )
                del packed, buffer  # freed before the bucket after next is packed
        finally:
            await asyncio.gather(packing, return_exceptions=True)  # the generator is never left mid-step
        return hasher.hexdigest()


def _hash_bucket(hasher: WeightsHasher, buffer: torch.Tensor, metas: list) -> None:
    hasher.update_all(unpack_bucket(buffer.cpu(), metas))
