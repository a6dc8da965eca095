"""Shared-memory transport, receiver side: a version read from its file in /dev/shm.

No vLLM here: fleetrl's weight-transfer backend (engine/weight_receiver.py) drives it in every
rank, and hashes and loads what it returns.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import torch

from fleetrl.weights.buckets import layout, unpack_bucket
from fleetrl.weights.shm.wire import FILE_NAME, SHM_DIR, ShmInit, ShmVersion


class ShmReceiver:
    @classmethod
    def join(cls, init: ShmInit, worker_rank: int) -> ShmReceiver:
        """Nothing to join: each update names a file every rank of the host reads."""
        return cls()

    @property
    def state(self) -> str:
        return ""

    def receive(self, update: ShmVersion) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The version's tensors, read from its file into this rank's own memory and checked
        there: size and sha256 as the record says, so what loads is what was hashed, whatever
        happens to the file afterwards. Only a version file of this user, in SHM_DIR, is read."""
        metas = update.metas()
        _, total = layout(metas)
        path = Path(update.path)
        if path.parent != SHM_DIR or not FILE_NAME.fullmatch(path.name):
            raise ValueError(f"shm transport: {path} is not a version file in {SHM_DIR}")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd, "rb") as file:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid() or found.st_nlink != 1:
                raise ValueError(f"shm transport: {path} is not a file of this user's alone")
            if found.st_size != total:
                raise ValueError(f"shm transport: {path} holds {found.st_size} bytes, its record {total}")
            buffer = torch.empty(total, dtype=torch.uint8)
            if file.readinto(memoryview(buffer.numpy())) != total or file.read(1):
                raise ValueError(f"shm transport: {path} changed size while it was read")
        if hashlib.sha256(buffer.numpy()).hexdigest() != update.sha256:
            raise ValueError(f"shm transport: {path} does not match its sha256 {update.sha256}")
        yield unpack_bucket(buffer, metas)

    def reset_on_failure(self) -> None:
        """Nothing to reset: the next update reads its own file."""

    def close(self) -> None:
        """Nothing to release: a version's memory lives as long as the tensors viewing it."""
