"""File helpers shared by everything that writes artifacts meant to survive a crash (a leaf)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from fleetrl.errors import FleetrlError


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
    # A name of its own for each write: two writers of one file (`fleetrl plot` while the run
    # draws its plots as it finishes) once shared one temporary name, and the second's rename
    # found it gone.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:  # the umask applies
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable: the directory entry itself is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_line(path: Path, line: str) -> None:
    """Append one line and sync it to disk before returning, for files that grow by a line at a
    time (metrics.jsonl): a crash loses at most the line being written, and leaves it torn
    rather than missing lines before it. Readers drop a torn last line (`read_json_lines`)."""
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_json_lines(path: Path, warn: Callable[[str], None]) -> list:
    """The values of a file of one JSON value per line that grows by `append_line`; [] if there
    is no such file. A kill in the middle of an append leaves the last line torn: it is dropped,
    and `warn` told so. Any other bad line cannot come from a torn append, so it is an error
    naming the line: the file was damaged, and guessing would hide it."""
    if not path.exists():
        return []
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    values = []
    for number, line in lines:
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number != lines[-1][0]:
                raise FleetrlError(f"{path}: line {number} is not JSON ({e.msg}); only the last line "
                                   f"may be torn (by a kill mid-write), so the file is damaged") from None
            warn(f"fleetrl: {path}: dropped its last line {number}, torn by a kill mid-write")
    return values
