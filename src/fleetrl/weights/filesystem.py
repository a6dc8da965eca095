"""Filesystem transport, sender side: the trainer writes the version as safetensors shards
+ manifest on storage every worker can read (at the same path), then each worker verifies
and loads it. Slower than a broadcast, but needs no network path from workers to the
trainer, and leaves a verifiable copy of every recent version behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fleetrl.weights import rpc
from fleetrl.weights.manifest import MANIFEST, collect_garbage, write_version

if TYPE_CHECKING:
    from fleetrl.inference.provider import WorkerAdmin
    from fleetrl.weights.transport import NamedTensors

# The version being published and the one before it (a worker may still be refitted from it).
KEEP_VERSIONS = 2


class FilesystemTransport:
    name = "filesystem"

    def __init__(self, storage_dir: Path, shard_bytes: int, timeout_s: float) -> None:
        self.storage_dir = storage_dir
        self.shard_bytes = shard_bytes
        self.timeout_s = timeout_s

    async def transfer(self, workers: Sequence[WorkerAdmin], named_tensors: NamedTensors,
                       version: int) -> str:
        manifest = await asyncio.to_thread(
            write_version, self.storage_dir, version, named_tensors(), self.shard_bytes)
        update_info = {"manifest": str((manifest.folder / MANIFEST).resolve())}
        try:
            # Cheap (no group to join), so done every time: a restarted worker needs it too.
            await rpc.on_all(workers, lambda w: w.init_weight_transfer({"transport": "filesystem"}, self.timeout_s))
            await rpc.on_all(workers, lambda w: w.start_weight_update(self.timeout_s))
            await rpc.on_all(workers, lambda w: w.update_weights(update_info, self.timeout_s))
            await rpc.on_all(workers, lambda w: w.finish_weight_update(version, self.timeout_s))
        except BaseException:
            await rpc.abandon_update(workers, version)
            raise
        await asyncio.to_thread(collect_garbage, self.storage_dir, KEEP_VERSIONS)
        return manifest.checksum

    async def close(self) -> None:
        """Nothing to release: the files stay for the next publish (or a refit)."""
