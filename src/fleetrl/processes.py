"""Child processes that never outlive fleetrl.

Every server or rank fleetrl starts goes through `start_process`: it runs in its own process
group (so its own children — vLLM's engine core, say — are stopped with it), it is told by the
kernel to die if fleetrl dies (PR_SET_PDEATHSIG, for a SIGKILLed parent), and it is recorded so
that `stop_all` (run at exit, on SIGTERM and on Ctrl-C) ends whatever is still running.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fleetrl.errors import FleetrlError

_PR_SET_PDEATHSIG = 1
# How long a child may take to exit after SIGTERM before it is killed: every process fleetrl
# started must be gone within 10 s of a signal to fleetrl, and a vLLM server exits in 1-3 s.
STOP_GRACE_S = 5.0
_live: list["ManagedProcess"] = []
_lock = threading.Lock()
# Set when fleetrl exits or is told to (SIGTERM): from then on nothing starts, so a thread that
# reacts to the stopping (a fleet restarting the workers it sees die) cannot leave a process behind.
_stopping = threading.Event()


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left after `grace_s`."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self._group_alive():
                time.sleep(0.1)
            if not self._group_alive():
                break
        with _lock:
            if self in _live:
                _live.remove(self)

    def _group_alive(self) -> bool:
        self.popen.poll()  # reap the leader if it exited, or it lingers as a zombie member
        try:
            os.killpg(self.pid, 0)
            return True
        except ProcessLookupError:
            return False


# Resolved here, in the parent: between fork and exec the child may only make plain calls, and
# loading a library there (dlopen takes locks another thread of fleetrl may have held at the
# fork) could deadlock it.
_prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl


def _die_with_parent() -> None:
    """Runs in the child between fork and exec (the session comes from start_new_session)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str) -> int:
    """A port on `host` that is free now (a child process binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_process(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                  cwd: Path | None = None, watches_parent: bool = False) -> ManagedProcess:
    """Start `argv` in a new process group. Unless the program `watches_parent` itself (and
    then takes its own group down when fleetrl dies, children included), the kernel kills it
    when fleetrl dies."""
    install_signal_handlers()
    if _stopping.is_set():
        raise FleetrlError(f"not starting {name}: fleetrl is stopping")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    try:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            start_new_session=True,
            preexec_fn=None if watches_parent else _die_with_parent,
        )
    finally:
        log.close()
    proc = ManagedProcess(name=name, popen=popen, log_path=log_path)
    with _lock:
        _live.append(proc)
        started_while_stopping = _stopping.is_set()
    if started_while_stopping:  # stop_all began between the check above and now
        proc.stop(grace_s=0)
        raise FleetrlError(f"not starting {name}: fleetrl is stopping")
    return proc


def stop_all() -> None:
    with _lock:
        procs = list(_live)
    # Signal everyone first so they shut down in parallel, then wait for each.
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.stop()


_handlers_installed = False


def _stop_for_good() -> None:
    """fleetrl is ending: stop every child, and start none after."""
    _stopping.set()
    stop_all()


def install_signal_handlers() -> None:
    """At exit and on SIGTERM, stop every child. Signal handlers can only be set from the main
    thread: a caller that starts processes from another thread calls this first, from main."""
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    _handlers_installed = True
    atexit.register(_stop_for_good)
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        _stop_for_good()
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
