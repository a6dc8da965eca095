"""The filesystem transport's wire records, in the envelope of weights/wire.py:

    init_info    FilesystemInit  what the updates replace: there is no group to join
    update_info  ManifestInfo    a whole published version
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from fleetrl.weights.target import GrouplessInit


@dataclass(frozen=True)
class FilesystemInit(GrouplessInit):
    transport: ClassVar[str] = "filesystem"


@dataclass(frozen=True)
class ManifestInfo:
    """A whole version on shared storage: the path of its manifest.json, as every worker sees it."""

    manifest: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
