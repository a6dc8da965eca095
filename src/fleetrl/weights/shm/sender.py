"""Shared-memory transport, sender side: the trainer packs the version, bucket by bucket, into
one file in the host's shared memory (laid out as one bucket of weights/buckets.py, so the
buckets are simply written one after the other), then every worker reads and loads it. Only
for workers on the trainer's host; the file is removed once the update is over, whether it
finished or failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from fleetrl.inference.provider import NamedTensors, WeightSyncClient
from fleetrl.transports import SenderSettings
from fleetrl.weights import fanout
from fleetrl.weights.buckets import packed_buckets, unpack_bucket
from fleetrl.weights.checksum import WeightsHasher
from fleetrl.weights.shm.wire import FILE_NAME, SHM_DIR, ShmInit, ShmVersion
from fleetrl.weights.target import UpdateTarget


class ShmTransport:
    name = "shm"

    def __init__(self, folder: Path, bucket_bytes: int, timeout_s: float, target: UpdateTarget = "model") -> None:
        self.folder = folder
        self.bucket_bytes = bucket_bytes  # what is packed at once on its way into the file
        self.timeout_s = timeout_s
        self.target = target
        remove_orphans(folder)

    @classmethod
    def from_settings(cls, settings: SenderSettings) -> ShmTransport:
        return cls(SHM_DIR, settings.bucket_bytes, settings.timeout_s, settings.target)

    async def transfer(self, workers: Sequence[WeightSyncClient], named_tensors: NamedTensors,
                       version: int) -> str:
        path = self.folder / f"fleetrl-weights-{os.getpid()}-{uuid.uuid4().hex}-v{version}.bin"
        # Readable by this user alone (the workers run as the trainer's user), from creation on;
        # the name is new, so a file someone else made there is refused, and never removed below.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            update_info, checksum = await asyncio.to_thread(self._write, fd, path, named_tensors())
            await fanout.update_in_phases(workers, ShmInit(target=self.target).to_dict(), update_info, version,
                                          self.timeout_s)
        finally:
            # Each worker rank loaded its own copy, or the update failed: the file is done with.
            path.unlink(missing_ok=True)
        return checksum

    async def close(self) -> None:
        """Nothing to release: each version's file is gone once its update is over."""

    def _write(self, fd: int, path: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict, str]:
        """The version's update record and its checksum (weights/checksum.py), the file (open
        at `fd`) written from packed buckets and hashed as it is written."""
        hasher, file_hash, metas = WeightsHasher(), hashlib.sha256(), []
        with open(fd, "wb") as out:
            for buffer, bucket_metas in packed_buckets(tensors, self.bucket_bytes, torch.device("cpu")):
                data = buffer.numpy()
                out.write(data)
                file_hash.update(data)
                hasher.update_all(unpack_bucket(buffer, bucket_metas))
                metas.extend(bucket_metas)
        if not metas:
            raise fanout.WeightTransferError("shm transport: no tensors to send")
        return ShmVersion.of(str(path), file_hash.hexdigest(), metas).to_dict(), hasher.hexdigest()


def remove_orphans(folder: Path) -> None:
    """Removes this user's version files whose writer is dead: a trainer killed during a
    transfer never reached its own removal, and shared memory is the host's RAM."""
    for path in folder.glob("fleetrl-weights-*.bin"):
        match = FILE_NAME.fullmatch(path.name)
        try:
            if match and path.lstat().st_uid == os.getuid() and not _alive(int(match.group(1))):
                path.unlink()
        except FileNotFoundError:
            pass  # another transport removed it first


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True
