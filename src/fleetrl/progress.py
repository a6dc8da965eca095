"""Progress of long waits (the model conversion, the workers' start-up): a bar on a terminal,
a line every REPORT_S otherwise (a log file, CI, a pipe).

On a terminal the bar is drawn by rich: inside `fleetrl rl`'s live view when one is showing
(`share_with`: there can be one live display at a time), else on its own. Whether output is a
terminal is decided once per process (`interactive`), and `run.live_view = "off"` turns it off.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

REPORT_S = 15.0  # how often a plain line reports a wait that goes on

_interactive: bool | None = None  # None: whether stdout is a terminal
_shared: Any = None  # the live view's rich Progress, while it shows


def interactive() -> bool:
    return sys.stdout.isatty() if _interactive is None else _interactive


def set_interactive(on: bool | None) -> None:
    """True/False: bars or plain lines whatever stdout is; None: decided by stdout again."""
    global _interactive
    _interactive = on


def share_with(progress: Any) -> None:
    """Bars go into `progress` (a rich Progress the live view renders) until called with None."""
    global _shared
    _shared = progress


class Task:
    """One wait's progress: `update(done, detail)` as it goes."""

    def __init__(self, what: str, total: int | None, log: Callable[[str], None]) -> None:
        self.what, self.total, self.log = what, total, log
        self.started = self._last_report = time.monotonic()
        self._bar: Any = None  # (rich Progress, task id) on a terminal

    def update(self, done: int | None = None, detail: str = "") -> None:
        if self._bar is not None:
            progress, task = self._bar
            progress.update(task, completed=done or 0, detail=detail)
        elif (now := time.monotonic()) - self._last_report >= REPORT_S:
            self.log(f"fleetrl: waiting for {self.what}: {detail} ({now - self.started:.0f} s)")
            self._last_report = now


def columns() -> list:
    """The columns of every bar (the live view's Progress is made with them too): what, the
    bar, done/total, the time taken and left, and the task's `detail` field."""
    from rich.progress import (BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    return [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("[dim]{task.fields[detail]}")]


@contextmanager
def progress_bar(what: str, total: int | None = None, log: Callable[[str], None] = print,
                 label: str | None = None) -> Iterator[Task]:
    """A bar labelled `label` (default: `what`) for the wait for `what` (`total` steps; None:
    a spinner and the time it has taken); off a terminal, "waiting for `what`" lines."""
    task = Task(what, total, log)
    if not interactive():
        yield task
        return
    from rich.progress import Progress

    own = None
    progress = _shared
    if progress is None:
        own = progress = Progress(*columns(), transient=True)
        own.start()
    task_id = progress.add_task(label or what, total=total, detail="")
    task._bar = (progress, task_id)
    try:
        yield task
    finally:
        progress.remove_task(task_id)
        if own is not None:
            own.stop()
