"""File helpers shared by everything that writes artifacts meant to survive a crash (a leaf)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write(path: Path, data: str | bytes, durable: bool = False) -> Path:
    """Write `path` whole or not at all: a reader, or a crash, sees the old file or the new one,
    never half of one (a temporary name beside it, then a rename). `durable` also syncs the
    contents to disk before the rename, for files that must survive a power loss too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable: the directory entry itself is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
