"""The filesystem transport's wire records, in the envelope of weights/wire.py:

    init_info    FilesystemInit  what the updates replace: there is no group to join
    update_info  ManifestInfo    a whole published version
"""

from __future__ import annotations

from typing import ClassVar

from fleetrl.strict import Strict
from fleetrl.weights.target import GrouplessInit


class FilesystemInit(GrouplessInit):
    transport: ClassVar[str] = "filesystem"


class ManifestInfo(Strict):
    """A whole version on shared storage: the path of its manifest.json, as every worker sees it."""

    manifest: str
