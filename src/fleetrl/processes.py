"""Child processes that never outlive fleetrl.

Every server or rank fleetrl starts goes through `start_process`: it runs in its own process
group (so its own children — vLLM's engine core, say — are stopped with it), it is told by the
kernel to die if fleetrl dies (PR_SET_PDEATHSIG, for a SIGKILLed parent), and it is recorded so
that `stop_all` (run at exit, on SIGTERM and on Ctrl-C) ends whatever is still running. A
watchdog thread bounds a stop whose main thread is stuck in C (a gloo collective on a hung
rank), where Python never runs the signal's handler, or overruns its bound: see
`_watch_for_stop_signals`. A graceful stop's waits end before the watchdog's exit
(`stop_time_left`). A child forked without exec (a reward's multiprocessing pool) takes none of
this with it: see `_forget_in_child`.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV
from fleetrl.errors import FleetrlError

# fleetrl's own tokens: never in a child's environment unless the caller names them (start_process).
SECRET_ENV = (ADMIN_TOKEN_ENV, DATA_TOKEN_ENV)

_PR_SET_PDEATHSIG = 1
# How long a child may take to exit after SIGTERM before it is killed: every process fleetrl
# started must be gone within 10 s of a signal to fleetrl, and a vLLM server exits in 1-3 s.
STOP_GRACE_S = 5.0
KILL_WAIT_S = 2.0  # for the kernel to end a SIGKILLed group
# fleetrl and every process it started end within STOP_BOUND_S of a SIGTERM or SIGINT: every
# bound of a stop derives from it. A graceful stop ends its waits STOP_WAITS_S after the signal
# (`stop_time_left`), leaving 1 s for its last steps (files, no waits) before the watchdog's
# exit at WATCHDOG_EXIT_S, where fleetrl has not ended by then (1 s left for the kernel to end
# fleetrl itself); the watchdog's stop_all, begun at WATCHDOG_STOP_S, ends by its exit.
STOP_BOUND_S = 10.0
WATCHDOG_EXIT_S = STOP_BOUND_S - 1.0
STOP_WAITS_S = WATCHDOG_EXIT_S - 1.0
WATCHDOG_STOP_S = WATCHDOG_EXIT_S - STOP_GRACE_S - KILL_WAIT_S
_live: list["ManagedProcess"] = []
_lock = threading.Lock()
_starter: ThreadPoolExecutor | None = None  # start_piped's thread, started on first use
# Set when fleetrl exits or is told to (SIGTERM): from then on nothing starts, so a thread that
# reacts to the stopping (a fleet restarting the workers it sees die) cannot leave a process behind.
_stopping = threading.Event()
_stop_signal: int | None = None  # the first SIGTERM or SIGINT, as the watchdog saw it arrive
_stop_signal_at: float | None = None  # when the watchdog saw it (time.monotonic())
# What a graceful stop would have undone and the watchdog's exit must not leave behind (a run's
# tokens file): run by the watchdog just before it exits (`at_forced_exit`).
_forced_exit_cleanups: list[Callable[[], None]] = []


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path
    started_at: float | None = None  # its leader's start (`started_at`): its group is signalled only while it is this one

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
        stop_groups([self], grace_s)


def _running(procs: list[ManagedProcess]) -> list[ManagedProcess]:
    """Those of `procs` whose process group has a process that is not a zombie."""
    for proc in procs:
        proc.popen.poll()  # reap the leader if it exited
    groups = running_groups()
    return [proc for proc in procs if proc.pid in groups]


def running_groups() -> set[int]:
    """The process groups that have a process that is not a zombie (one read of /proc for all).
    An engine core's workers, orphaned as it exits, stay zombies until init reaps them: a
    second or two here, never on a machine whose init does not reap; they run nothing and
    hold nothing."""
    groups = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # it exited while we looked
        if state not in ("Z", "X"):
            groups.add(int(group))
    return groups


def stop_groups(procs: list[ManagedProcess], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process group of `procs` at once, then SIGKILL what is left after
    `grace_s`: all shut down in parallel, within grace_s + KILL_WAIT_S together."""
    end_groups([proc.pid for proc in procs if owned_group(proc.pid, proc.started_at)], grace_s)
    for proc in procs:
        proc.popen.poll()  # its leader has exited: reaped, not left a zombie
    with _lock:
        for proc in procs:
            if proc in _live:
                _live.remove(proc)


def started_at(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch, as psutil reads it from /proc);
    None when there is no such process."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


def owned_group(pid: int, leader_started_at: float | None) -> bool:
    """Whether process group `pid`, whose leader started at `leader_started_at`, is still that
    group: its leader is the same process, or the leader is gone (the kernel gives no new
    process an id that a group still uses, so its members, if any, are that group's). A leader
    of another start time has the id of one that ended: a group that is not ours, and that a
    killpg must never reach. None: its start was not recorded, so it is taken as ours."""
    if leader_started_at is None:
        return True
    now = started_at(pid)
    return now is None or abs(now - leader_started_at) < 0.01


def end_groups(groups: list[int], grace_s: float = STOP_GRACE_S) -> list[int]:
    """SIGTERM the process groups (their leaders' pids) at once, then SIGKILL what is left of
    them after `grace_s`; the groups still running after KILL_WAIT_S more (none, normally).
    Zombies count as ended (`running_groups`). For fleetrl's children (`stop_groups`) and for
    groups it did not start (deploy/dynamo/'s, recorded by pid)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
        for group in groups:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while (groups := [g for g in groups if g in running_groups()]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not groups:
            break
    return groups


# Resolved here, in the parent: between fork and exec the child may only make plain calls, and
# loading a library there (dlopen takes locks another thread of fleetrl may have held at the
# fork) could deadlock it.
_prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl


def _die_with_parent() -> None:
    """Runs in the child between fork and exec."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _in_child(dies_with_parent: bool, cpus: tuple[int, ...]) -> None:
    """Runs in the child between fork and exec: killed when fleetrl dies (unless it watches its
    parent itself), and bound to `cpus` where given, which every process it starts inherits."""
    if dies_with_parent:
        _die_with_parent()
    if cpus:
        os.sched_setaffinity(0, cpus)


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (read from /proc: a stopped process too)."""
    import psutil

    try:
        return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        return set()


def free_port(host: str) -> int:
    """A port on `host` that is free now (a child process binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_process(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                  cwd: Path | None = None, watches_parent: bool = False, cpus: list[int] = ()) -> ManagedProcess:
    """Start `argv` in a new process group. Unless the program `watches_parent` itself (and
    then takes its own group down when fleetrl dies, children included), the kernel kills it
    when fleetrl dies. It gets fleetrl's environment without fleetrl's tokens, plus `env`: a
    child that needs a token (a vLLM server's middleware) is given it there, by name. It runs on
    `cpus` where given, its children too."""
    install_signal_handlers()
    if stopping():
        raise FleetrlError(f"not starting {name}: fleetrl is stopping")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    try:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**{k: v for k, v in os.environ.items() if k not in SECRET_ENV}, **(env or {})},
            cwd=cwd,
            start_new_session=True,
            preexec_fn=None if watches_parent and not cpus else functools.partial(_in_child, not watches_parent,
                                                                                  tuple(cpus)),
        )
    finally:
        log.close()
    proc = ManagedProcess(name=name, popen=popen, log_path=log_path, started_at=started_at(popen.pid))
    with _lock:
        _live.append(proc)
        started_while_stopping = _stopping.is_set()
    if started_while_stopping:  # stop_all began between the check above and now
        proc.stop(grace_s=0)
        raise FleetrlError(f"not starting {name}: fleetrl is stopping")
    return proc


def start_piped(argv: list[str]) -> subprocess.Popen:
    """`argv` with pipes to its stdin and stdout (and fleetrl's stderr), without fleetrl's
    tokens, killed by the kernel when fleetrl dies: a helper process that a caller owns (a
    reward's worker) and kills itself, so not one that `stop_all` knows of. It stays in
    fleetrl's process group: it is part of fleetrl, not a server with a group of its own."""
    with _lock:
        global _starter
        _starter = _starter or ThreadPoolExecutor(1, thread_name_prefix="fleetrl-starter")
    # Started by one long-lived thread: the parent-death signal comes when the *thread* that
    # started a child ends, and a caller's thread (the orchestrator's, per reward call) ends first.
    return _starter.submit(
        subprocess.Popen, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={k: v for k, v in os.environ.items() if k not in SECRET_ENV}, preexec_fn=_die_with_parent).result()


def stopping() -> bool:
    """Whether fleetrl is ending (at exit, or told to by SIGTERM): nothing starts any more."""
    return _stopping.is_set()


def stop_signal() -> int | None:
    """The SIGTERM or SIGINT that told fleetrl to stop (the first one), or None."""
    return _stop_signal


def stop_time_left(began: float) -> float:
    """Seconds left for the waits of a graceful stop begun at `began` (time.monotonic()): they
    end STOP_WAITS_S after the stop began or after the stop signal, whichever came first, so
    that the stop is done before the watchdog's exit cuts it."""
    first = began if _stop_signal_at is None else min(began, _stop_signal_at)
    return max(0.0, first + STOP_WAITS_S - time.monotonic())


def at_forced_exit(cleanup: Callable[[], None]) -> None:
    """Have the watchdog run `cleanup` before it exits, until `cancel_at_forced_exit`: what
    the graceful stop it cuts short would have undone (removing a run's tokens file, say).
    It runs on the watchdog's thread while the main thread may hold any lock: quick, and
    taking none."""
    _forced_exit_cleanups.append(cleanup)


def cancel_at_forced_exit(cleanup: Callable[[], None]) -> None:
    """The graceful stop has done what `cleanup` does (or no longer may: the run directory is let go)."""
    if cleanup in _forced_exit_cleanups:
        _forced_exit_cleanups.remove(cleanup)


def stop_all() -> None:
    with _lock:
        procs = list(_live)
    stop_groups(procs)


_handlers_installed = False


def _stop_for_good() -> None:
    """fleetrl is ending: stop every child, and start none after."""
    _stopping.set()
    stop_all()


def install_signal_handlers() -> None:
    """At exit and on SIGTERM, stop every child; on SIGTERM or SIGINT, also bound the stop (the
    watchdog). Signal handlers and the wakeup fd can only be set from the main thread: a caller
    that starts processes from another thread calls this first, from main."""
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
    wakeups, wakeup_fd = socket.socketpair()
    wakeup_fd.setblocking(False)  # the C handler's write must never block a thread
    signal.set_wakeup_fd(wakeup_fd.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_watch_for_stop_signals, args=(wakeups, wakeup_fd), name="fleetrl-stop-watchdog",
                     daemon=True).start()


def _forget_in_child() -> None:
    """In the child of a fork without exec (a reward's fork `multiprocessing.Pool`,
    `datasets.map(num_proc=N)`): fleetrl's stop is not the child's. As the fork copied them, a
    SIGTERM to the child (a pool's terminate) had the C-level handler write to the parent's
    wakeup fd, whose watchdog took it for fleetrl's own and ended a healthy run, and ran
    `on_sigterm`, which stopped every server and rank in the child's copy of `_live`. The
    child gets SIGTERM's default (it ends) and no wakeup fd; the processes and cleanups it knew
    of are the parent's. (The forking thread is the child's main thread: the signal calls are
    allowed there.)"""
    global _handlers_installed, _lock, _starter
    if _handlers_installed:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _handlers_installed = False
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _starter = None  # its thread is the parent's
    _live.clear()
    _forced_exit_cleanups.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _watch_for_stop_signals(wakeups: socket.socket, wakeup_fd: socket.socket) -> None:
    """Bound fleetrl's stop. Python runs a signal's handler on the main thread between two
    bytecodes: never while that thread waits in C (a gloo collective on a hung rank retries
    through the signal), and then neither the graceful stop nor the children's stop happens.
    The signal number is written to the wakeup fd by the C-level handler as the signal
    arrives, whatever the main thread does; woken by the first SIGTERM or SIGINT, this thread
    stops every child WATCHDOG_STOP_S later and exits WATCHDOG_EXIT_S after the signal
    (128 + its number), after the `at_forced_exit` cleanups, unless fleetrl ended first: its
    main thread waits in a call no signal interrupts, or its stop overran its bound. One line
    on stderr says where that thread is. `wakeup_fd` is held here: the process's wakeup fd
    must stay open as long as this thread waits on it."""
    global _stop_signal, _stop_signal_at
    signum = None
    while signum is None:
        received = wakeups.recv(64)
        seen_at = time.monotonic()
        signum = next((s for s in received if s in (signal.SIGTERM, signal.SIGINT)), None)
    _stop_signal_at, _stop_signal = seen_at, signum
    time.sleep(WATCHDOG_STOP_S)
    _stopping.set()
    stop_all()
    time.sleep(max(0.0, seen_at + WATCHDOG_EXIT_S - time.monotonic()))
    exit_now(128 + signum, f"fleetrl: not ended {WATCHDOG_EXIT_S:.0f} s after {signal.Signals(signum).name}: its "
                           f"processes are stopped; exiting. Its main thread is still in {main_thread_at()}: a call "
                           "no signal interrupts (a collective on a hung rank, say), or a stop that overran its bound")


def main_thread_at() -> str:
    """Where the main thread is (file, line, function), for a line that says why it did not end."""
    main = sys._current_frames().get(threading.main_thread().ident)
    return f"{main.f_code.co_filename}:{main.f_lineno} ({main.f_code.co_name})" if main else "no Python code"


def exit_now(status: int, line: str) -> None:
    """End fleetrl from a thread other than the main one, which waits in a call that nothing
    interrupts: every child stopped, the `at_forced_exit` cleanups run, `line` on stderr, and the
    exit with `status`, at once."""
    _stopping.set()
    stop_all()
    for cleanup in list(_forced_exit_cleanups):
        try:
            cleanup()
        except Exception as e:  # the others still run, and the exit still comes
            os.write(2, f"fleetrl: a cleanup before exiting failed: {type(e).__name__}: {e}\n".encode())
    os.write(2, f"{line}\n".encode())
    os._exit(status)
