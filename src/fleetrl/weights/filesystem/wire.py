"""The filesystem transport's wire records, in the envelope of weights/wire.py:

    init_info    FilesystemInit  nothing but the transport's name: there is no group to join
    update_info  ManifestInfo    a whole published version
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class FilesystemInit:
    transport: ClassVar[str] = "filesystem"

    def to_dict(self) -> dict[str, Any]:
        return {"transport": self.transport}


@dataclass(frozen=True)
class ManifestInfo:
    """A whole version on shared storage: the path of its manifest.json, as every worker sees it."""

    manifest: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
