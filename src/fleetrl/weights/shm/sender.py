"""Shared-memory transport, sender side: the trainer packs the version, bucket by bucket, into
one file in the host's shared memory (laid out as one bucket of weights/buckets.py, so the
buckets are simply written one after the other), then every worker maps and loads it. Only
for workers on the trainer's host; the file is removed once the update is over, whether it
finished or failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from fleetrl.inference.provider import NamedTensors, WeightSyncClient
from fleetrl.transports import SenderSettings
from fleetrl.weights import fanout
from fleetrl.weights.buckets import packed_buckets, unpack_bucket
from fleetrl.weights.checksum import WeightsHasher
from fleetrl.weights.shm.wire import ShmInit, ShmVersion
from fleetrl.weights.target import UpdateTarget

# The host's shared memory where it has one (Linux); the temporary folder otherwise.
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class ShmTransport:
    name = "shm"

    def __init__(self, folder: Path, bucket_bytes: int, timeout_s: float, target: UpdateTarget = "model") -> None:
        self.folder = folder
        self.bucket_bytes = bucket_bytes  # what is packed at once on its way into the file
        self.timeout_s = timeout_s
        self.target = target
        self._prefix = f"fleetrl-weights-{uuid.uuid4().hex[:12]}"  # this transport's files only

    @classmethod
    def from_settings(cls, settings: SenderSettings) -> ShmTransport:
        return cls(SHM_DIR, settings.bucket_bytes, settings.timeout_s, settings.target)

    async def transfer(self, workers: Sequence[WeightSyncClient], named_tensors: NamedTensors,
                       version: int) -> str:
        path = self.folder / f"{self._prefix}-v{version}.bin"
        try:
            update_info, checksum = await asyncio.to_thread(self._write, path, named_tensors())
            await fanout.update_in_phases(workers, ShmInit(target=self.target).to_dict(), update_info, version,
                                          self.timeout_s)
        finally:
            # The workers' mappings outlive the name: the memory is freed with the last of them.
            path.unlink(missing_ok=True)
        return checksum

    async def close(self) -> None:
        """Nothing to release: each version's file is gone once its update is over."""

    def _write(self, path: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict, str]:
        """The version's update record and its checksum (weights/checksum.py), the file written
        from packed buckets and hashed as it is written."""
        hasher, file_hash, metas = WeightsHasher(), hashlib.sha256(), []
        # Readable by this user alone (the workers run as the trainer's user), from creation on.
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            for buffer, bucket_metas in packed_buckets(tensors, self.bucket_bytes, torch.device("cpu")):
                data = buffer.numpy()
                out.write(data)
                file_hash.update(data)
                hasher.update_all(unpack_bucket(buffer, bucket_metas))
                metas.extend(bucket_metas)
        if not metas:
            raise fanout.WeightTransferError("shm transport: no tensors to send")
        return ShmVersion.of(str(path), file_hash.hexdigest(), metas).to_dict(), hasher.hexdigest()
