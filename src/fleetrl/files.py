"""File helpers shared by everything that writes artifacts meant to survive a crash (a leaf)."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import secrets
import threading
from collections.abc import Callable
from pathlib import Path

from fleetrl.errors import FleetrlError


def fleetrl_cache() -> Path:
    """fleetrl's cache folder (the embedded model, converted data files): $FLEETRL_CACHE, else
    fleetrl under $XDG_CACHE_HOME or ~/.cache."""
    if env := os.environ.get("FLEETRL_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fleetrl"


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


class LineWriter:
    """A file that grows by a line at a time, written and synced to disk by a thread of its
    own, so a caller on an event loop (every sample of every rollout) never waits for the disk.
    Lines land in the order appended; `flush` returns once every line appended before it is
    synced; a crash loses at most the lines not yet synced (the last one perhaps torn, which
    `read_json_lines` drops). What the writer raises (a full disk) is raised by the next call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._queue: queue.Queue[str | threading.Event | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self._error: BaseException | None = None

    def append(self, line: str) -> None:
        self._check()
        with self._start:
            if self._thread is None:  # on first use: the file may be rewritten before it (a resume's trim)
                self._thread = threading.Thread(target=self._write, name=f"fleetrl-{self.path.name}", daemon=True)
                self._thread.start()
        self._queue.put(line)

    def flush(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            synced = threading.Event()
            self._queue.put(synced)
            synced.wait()
        self._check()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._check()

    def _check(self) -> None:
        if self._error is not None:
            raise FleetrlError(f"{self.path}: writing failed: {self._error}")

    def _write(self) -> None:
        items: list[str | threading.Event | None] = []
        try:
            with open(self.path, "a") as f:
                while None not in items:
                    items = [self._queue.get()]
                    while not self._queue.empty():  # everything waiting goes out with one sync
                        items.append(self._queue.get())
                    f.writelines(item + "\n" for item in items if isinstance(item, str))
                    f.flush()
                    os.fsync(f.fileno())
                    self._release(items)
        except BaseException as e:
            self._error = e
            self._release(items)
            while not self._queue.empty():  # nobody may wait on a flush forever
                self._release([self._queue.get()])

    @staticmethod
    def _release(items: list) -> None:
        for item in items:
            if isinstance(item, threading.Event):
                item.set()


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
