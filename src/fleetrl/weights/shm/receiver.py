"""Shared-memory transport, receiver side: a version mapped from its file in /dev/shm.

No vLLM here: fleetrl's weight-transfer backend (engine/weight_receiver.py) drives it in every
rank, and hashes and loads what it returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import torch

from fleetrl.weights.buckets import layout, unpack_bucket
from fleetrl.weights.shm.wire import ShmInit, ShmVersion


class ShmReceiver:
    @classmethod
    def join(cls, init: ShmInit, worker_rank: int) -> ShmReceiver:
        """Nothing to join: each update names a file every rank of the host maps."""
        return cls()

    @property
    def state(self) -> str:
        return ""

    def receive(self, update: ShmVersion) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The version's tensors: views into a private mapping of its file (pages are copied
        only if written), once the file's size and sha256 match the record's, so a changed or
        truncated file is refused before any tensor loads."""
        metas = update.metas()
        _, total = layout(metas)
        path = Path(update.path)
        if path.stat().st_size != total:
            raise ValueError(f"shm transport: {path} holds {path.stat().st_size} bytes, its record {total}")
        buffer = torch.from_file(str(path), shared=False, size=total, dtype=torch.uint8)
        if hashlib.sha256(buffer.numpy()).hexdigest() != update.sha256:
            raise ValueError(f"shm transport: {path} does not match its sha256 {update.sha256}")
        yield unpack_bucket(buffer, metas)

    def reset_on_failure(self) -> None:
        """Nothing to reset: the next update maps its own file."""

    def close(self) -> None:
        """Nothing to release: a mapping lives as long as the tensors viewing it."""
