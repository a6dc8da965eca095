"""The shared-memory transport's wire records, in the envelope of weights/wire.py:

    init_info    ShmInit     what the updates replace: there is no group to join
    update_info  ShmVersion  a whole version: its file, its tensors in order, its sha256
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from fleetrl.strict import Strict
from fleetrl.weights.buckets import TensorMeta
from fleetrl.weights.target import GrouplessInit

# The host's shared memory where it has one (Linux); the temporary folder otherwise.
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
# fleetrl-weights-{writer's pid}-{a random id per version}-v{version}.bin: the pid lets a later
# transport remove what a killed trainer left; the random id makes the name unguessable.
FILE_NAME = re.compile(r"fleetrl-weights-(\d+)-[0-9a-f]{32}-v\d+\.bin")


class ShmInit(GrouplessInit):
    transport: ClassVar[str] = "shm"


class ShmVersion(Strict):
    """A version packed in one file, laid out as one bucket (weights/buckets.py) of
    `tensors`, in send order."""

    path: str
    sha256: str  # of the file's bytes
    tensors: list[list[Any]]  # [name, dtype, shape], as JSON carries them

    @classmethod
    def of(cls, path: str, sha256: str, metas: list[TensorMeta]) -> ShmVersion:
        return cls(path=path, sha256=sha256, tensors=[[m.name, m.dtype, list(m.shape)] for m in metas])

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, dtype, tuple(shape)) for name, dtype, shape in self.tensors]
