"""Filesystem transport, sender side: the trainer writes the version as safetensors shards
+ manifest on storage every worker can read (at the same path), then each worker verifies
and loads it. Slower than a broadcast, but needs no network path from workers to the
trainer, and leaves a verifiable copy of every recent version behind. Older versions are
deleted as new ones are published, but only folders fleetrl wrote: the storage may be shared
(`manifest.collect_garbage`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from fleetrl.inference.provider import NamedTensors, WeightSyncClient
from fleetrl.transports import SenderSettings
from fleetrl.weights import fanout
from fleetrl.weights.filesystem.manifest import MANIFEST, collect_garbage, write_version
from fleetrl.weights.filesystem.wire import FilesystemInit, ManifestInfo
from fleetrl.weights.target import UpdateTarget

# The version being published and the one before it (a worker may still be refitted from it).
KEEP_VERSIONS = 2


class FilesystemTransport:
    name = "filesystem"

    def __init__(self, storage_dir: Path, shard_bytes: int, timeout_s: float, target: UpdateTarget = "model") -> None:
        self.storage_dir = storage_dir
        self.shard_bytes = shard_bytes
        self.timeout_s = timeout_s
        self.target = target

    @classmethod
    def from_settings(cls, settings: SenderSettings) -> FilesystemTransport:
        # The shard size is the bucket size: both bound what is held at once.
        return cls(settings.storage_dir, settings.bucket_bytes, settings.timeout_s, settings.target)

    async def transfer(self, workers: Sequence[WeightSyncClient], named_tensors: NamedTensors,
                       version: int) -> str:
        manifest = await asyncio.to_thread(
            write_version, self.storage_dir, version, named_tensors(), self.shard_bytes)
        update_info = ManifestInfo(manifest=str((manifest.folder / MANIFEST).resolve())).to_dict()
        await fanout.update_in_phases(workers, FilesystemInit(target=self.target).to_dict(), update_info, version,
                                      self.timeout_s)
        await asyncio.to_thread(collect_garbage, self.storage_dir, KEEP_VERSIONS)
        return manifest.checksum

    async def close(self) -> None:
        """Nothing to release: the files stay for the next publish (or a refit)."""
