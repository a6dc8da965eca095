"""Filesystem transport, receiver side: a published version read from shared storage.

No vLLM here: fleetrl's weight-transfer backend (engine/weight_receiver.py) drives it in every
rank, and hashes and loads what it returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from fleetrl.weights.filesystem.manifest import iter_tensors, read_manifest
from fleetrl.weights.filesystem.wire import ManifestInfo
from fleetrl.weights.target import GrouplessReceiver


class FilesystemReceiver(GrouplessReceiver):
    def receive(self, update: ManifestInfo) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The version's tensors on the CPU, one at a time in send order (never a second copy
        of the model), once all of it is verified (READY, every shard's sha256, every name,
        dtype and shape): a half-written or corrupted version is refused before any loads.
        Loaded from the CPU: the weight loaders copy into the model's device."""
        for named in iter_tensors(read_manifest(Path(update.manifest))):
            yield [named]
