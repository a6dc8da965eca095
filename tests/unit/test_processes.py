"""Child processes: finding the one behind a hung server (a real process, stopped); a stop
that ends them and fleetrl while its main thread is stuck in C, within the bound a graceful
stop keeps to; a forked child's SIGTERM, which is not fleetrl's; a dead trainer rank the main
thread waits on in a collective that missed its death."""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetrl.config import InferenceConfig
from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV
from fleetrl.inference.dynamo.launcher import DynamoDeployment
from fleetrl.processes import ManagedProcess, free_port, listening_ports, running_groups, start_process


def test_the_process_behind_a_hung_instance_is_found_by_its_listening_port(tmp_path):
    """Dynamo's discovery names an instance (its system URL), not a process: discovery finds the
    launched worker behind it (the one a restart replaces), also when it hangs (SIGSTOP: its
    socket stays open); an exited one serves no instance."""
    port = free_port("127.0.0.1")
    server = start_process("dynamo-worker-0", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                           tmp_path / "server.log")
    exited = start_process("dynamo-worker-1", [sys.executable, "-c", "pass"], tmp_path / "exited.log")
    try:
        deadline = time.monotonic() + 30
        while port not in listening_ports(server.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(server.pid, signal.SIGSTOP)
        assert port in listening_ports(server.pid)
        exited.popen.wait(timeout=30)
        deployment = DynamoDeployment("", "", server, [exited, server], tmp_path, InferenceConfig(), tmp_path)
        assert deployment.live_worker_at(f"http://127.0.0.1:{port}") is server
        assert deployment.live_worker_at("http://127.0.0.1:1") is None
    finally:
        os.killpg(server.pid, signal.SIGCONT)
        server.stop(grace_s=0)
    assert listening_ports(server.pid) == set()


def test_a_group_left_with_zombies_only_is_stopped(tmp_path):
    """An engine core's workers, orphaned as it exits, stay zombies until init reaps them (a
    second or two on this machine, never where init does not reap): they run nothing, so the
    group counts as stopped once only zombies are left, not after the grace and kill waits."""
    # The leader forks a child that exits at once and is never waited for: a zombie member.
    script = "import os, time\nif os.fork() == 0:\n    os._exit(0)\ntime.sleep(600)\n"
    leader = start_process("zombie-parent", [sys.executable, "-c", script], tmp_path / "leader.log")
    try:
        deadline = time.monotonic() + 30
        while len(_members(leader.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(state for _, state in _members(leader.pid)) == ["S", "Z"]
        assert leader.pid in running_groups()
        os.kill(leader.pid, signal.SIGKILL)
        leader.popen.wait()
        assert leader.pid not in running_groups()  # whether or not init has reaped the orphan yet
    finally:
        leader.stop(grace_s=0)


def _members(pgid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-eo", "pid,pgid,stat"], capture_output=True, text=True).stdout
    return [(int(pid), stat[0]) for pid, group, stat in (line.split() for line in out.splitlines()[1:])
            if int(group) == pgid]


def test_children_get_fleetrls_tokens_only_where_they_are_given(tmp_path, monkeypatch):
    """A trainer rank, etcd, NATS or a Dynamo process needs no token, yet each once inherited
    both from fleetrl's environment; a vLLM server's middleware gets them by name."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "admin-secret")
    monkeypatch.setenv(DATA_TOKEN_ENV, "data-secret")
    monkeypatch.setenv("FLEETRL_TEST_OTHER", "kept")
    show = [sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"]
    plain = start_process("trainer-rank-1", show, tmp_path / "plain.log")
    given = start_process("vllm-0", show, tmp_path / "given.log", env={ADMIN_TOKEN_ENV: "admin-secret"})
    for proc in (plain, given):
        proc.popen.wait(timeout=60)
    plain_env = json.loads((tmp_path / "plain.log").read_text())
    given_env = json.loads((tmp_path / "given.log").read_text())
    assert ADMIN_TOKEN_ENV not in plain_env and DATA_TOKEN_ENV not in plain_env
    assert plain_env["FLEETRL_TEST_OTHER"] == "kept"
    assert given_env[ADMIN_TOKEN_ENV] == "admin-secret" and DATA_TOKEN_ENV not in given_env


def test_a_process_started_on_cpus_runs_there_and_so_do_the_processes_it_starts(tmp_path):
    """A launched server's engine core is its child: binding the server binds the engine."""
    cpu = max(os.sched_getaffinity(0))
    show = "import os; print(sorted(os.sched_getaffinity(0)))"
    script = (f"import os, subprocess, sys; {show}; "
              f"subprocess.run([sys.executable, '-c', {show!r}], check=True)")
    for watches_parent in (False, True):  # with and without the parent-death signal set beside it
        log = tmp_path / f"bound-{watches_parent}.log"
        start_process("vllm-0", [sys.executable, "-c", script], log, cpus=[cpu],
                      watches_parent=watches_parent).popen.wait(timeout=60)
        assert log.read_text().split("\n")[:2] == [f"[{cpu}]"] * 2, log.read_text()


def test_a_group_id_another_process_took_is_never_signalled(tmp_path):
    """A group fleetrl started ends; its id is given to an unrelated process that leads a group
    of its own. Stopping the old one must not reach the new one, as a killpg by id once would."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        # As if fleetrl's leader had had this pid, and had started at another time.
        ended = ManagedProcess("vllm-0", other, tmp_path / "vllm-0.log", started_at=time.time() - 3600)
        ended.stop(grace_s=0.5)
        assert other.poll() is None  # not signalled
        mine = start_process("vllm-1", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "mine.log")
        mine.stop(grace_s=0.5)
        assert mine.popen.poll() is not None  # its own group is stopped as before
    finally:
        other.kill()
        other.wait()


# A fleetrl whose main thread waits in C the way a gloo collective waits on a hung rank: a call
# that resumes its wait through every signal and never returns to Python (a pthread mutex locked
# twice by one thread; a Lock.acquire or time.sleep would return to run the handler).
STUCK_IN_C = """
import ctypes, signal, sys
from pathlib import Path
from fleetrl.processes import at_forced_exit, start_process
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job may ignore it)
rank = start_process("trainer-rank-1", [sys.executable, "-c", "import time; time.sleep(600)"], Path(sys.argv[1]))
tokens = Path(sys.argv[2])
tokens.write_text("{}")
at_forced_exit(tokens.unlink)  # as a run has its tokens file removed
mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
libc = ctypes.CDLL("libc.so.6")
libc.pthread_mutex_lock(mutex)
print(rank.pid, flush=True)
libc.pthread_mutex_lock(mutex)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_fleetrl_and_its_children_while_its_main_thread_is_stuck_in_c(tmp_path, sig):
    """SIGTERM while rank 0 waited in a collective on a SIGSTOPped rank 1 left fleetrl and its
    children running for minutes: Python runs a handler only between bytecodes of the main
    thread. The watchdog, woken by the signal itself, stops the children and exits, after the
    cleanups registered for that exit (a run's tokens file was left on disk), saying where the
    main thread is (not always in C: a stop can overrun its bound)."""
    tokens = tmp_path / "tokens.json"
    fleetrl = subprocess.Popen([sys.executable, "-c", STUCK_IN_C, str(tmp_path / "rank-1.log"), str(tokens)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    rank = None
    try:
        rank = int(fleetrl.stdout.readline())
        os.kill(rank, signal.SIGSTOP)  # hung: only a SIGKILL ends it
        deadline = time.monotonic() + 60
        while _state(fleetrl.pid) != "S" and time.monotonic() < deadline:  # its main thread waits on the mutex
            time.sleep(0.05)
        assert tokens.exists()
        os.kill(fleetrl.pid, sig)
        assert fleetrl.wait(timeout=60) == 128 + sig
        assert rank not in running_groups()
        assert not tokens.exists()
        assert "Its main thread is still in <string>:" in fleetrl.stderr.read()
    finally:
        fleetrl.kill()
        fleetrl.wait()
        if rank is not None and rank in running_groups():
            os.killpg(rank, signal.SIGKILL)


# A fleetrl whose reward uses a fork multiprocessing pool, off the main thread as rewards run:
# leaving the `with` terminates (SIGTERMs) the pool's worker, still busy. Then it carries on,
# past the time the watchdog would have stopped its processes (WATCHDOG_STOP_S), and says
# whether its trainer rank still runs.
FORKS_A_POOL = """
import multiprocessing, sys, threading, time
from pathlib import Path
from fleetrl.processes import WATCHDOG_STOP_S, start_process
rank = start_process("trainer-rank-1", [sys.executable, "-c", "import time; time.sleep(600)"], Path(sys.argv[1]))
fork = multiprocessing.get_context("fork")
busy = fork.Event()  # the pool's worker inherits it
def work():
    busy.set()
    time.sleep(600)
def reward():
    with fork.Pool(1) as pool:
        pool.apply_async(work)
        assert busy.wait(60)
thread = threading.Thread(target=reward)
thread.start()
thread.join()
time.sleep(WATCHDOG_STOP_S + 2)
print(rank.alive(), flush=True)
"""


def test_a_forked_childs_sigterm_is_not_fleetrls(tmp_path):
    """A reward's fork pool worker, terminated as the pool closed, inherited fleetrl's wakeup fd
    and SIGTERM handler: its SIGTERM woke fleetrl's watchdog as if fleetrl had been told to
    stop (every process stopped at 2 s, exit 143 at 9 s: a healthy run killed), and its copy
    of the handler stopped fleetrl's processes itself. A forked child now has neither."""
    fleetrl = subprocess.run([sys.executable, "-c", FORKS_A_POOL, str(tmp_path / "rank-1.log")],
                             capture_output=True, text=True, timeout=120)
    assert fleetrl.returncode == 0, fleetrl.stderr
    assert fleetrl.stdout == "True\n"  # its rank ran until fleetrl's own exit stopped it


def test_a_stop_after_a_signal_ends_its_waits_before_the_watchdogs_exit(tmp_path, monkeypatch):
    """The watchdog exits 9 s after a SIGTERM or SIGINT, yet the run's stop gave the fleet's
    close 10 s, then the control loop 10 s and each rank 7 s in turn: a stop still under way
    was cut short, and the run's tokens file stayed on disk. Now every wait of the stop ends
    STOP_WAITS_S after the signal (or after the stop began), before the watchdog's exit."""
    from fleetrl import processes
    from fleetrl.app import rl
    from fleetrl.config import load_config

    assert processes.STOP_WAITS_S < processes.WATCHDOG_EXIT_S < processes.STOP_BOUND_S
    began = time.monotonic()
    assert 0 < processes.stop_time_left(began) <= processes.STOP_WAITS_S  # no signal: from the stop's start
    monkeypatch.setattr(processes, "_stop_signal_at", began + 3600)
    assert 0 < processes.stop_time_left(began) <= processes.STOP_WAITS_S  # a later signal moves nothing
    monkeypatch.setattr(processes, "_stop_signal_at", began - processes.STOP_WAITS_S)
    assert processes.stop_time_left(began) == 0  # the signal's time is up
    # The run's stop, 1 s before the signal's time is up: the close starts, and is given up.
    monkeypatch.setattr(processes, "_stop_signal_at", time.monotonic() + 1 - processes.STOP_WAITS_S)

    class Hangs:  # a fleet, and its transport, whose close never ends
        async def close(self):
            await asyncio.Event().wait()

    stopped = []
    monkeypatch.setattr(rl, "stop_all", lambda: stopped.append(True))
    logged = []
    run = rl.RLRun(load_config([], [("run.dir", str(tmp_path / "run"))]), log=logged.append)
    run.run_dir.record_fleet({}, {"admin_token": "secret"})
    run.fleet = run.transport = Hangs()
    processes.at_forced_exit(run.run_dir.forget_fleet)  # as start_fleet has it
    run.stop()
    # The close given up is a task left pending on the stopped loop (a real run exits next). Ended
    # here: left to the garbage collector, it ended inside a later test, whose ast.parse the
    # reported error's traceback re-entered (Python 3.11: "AST constructor recursion depth mismatch").
    run.control.thread.join()
    while pending := asyncio.all_tasks(run.control.loop):  # cancelled again at each close it awaits
        for task in pending:
            task.cancel()
        run.control.loop.run_until_complete(asyncio.wait(pending, timeout=1))
    run.control.loop.close()
    assert stopped and any("the fleet did not close within" in line for line in logged)
    assert not run.run_dir.tokens_path.exists() and not run.run_dir.fleet_path.exists()
    assert run.run_dir.forget_fleet not in processes._forced_exit_cleanups  # done: not again at an exit


def _state(pid: int) -> str:
    """The state of process `pid`'s main thread (R running, S sleeping, ...)."""
    return Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_collective_failed_by_fleetrls_own_stop_ends_the_run_as_the_signal_does(tmp_path, monkeypatch):
    """SIGTERM while rank 0 waited in a collective on a hung rank 1: the watchdog stopped rank 1,
    the collective failed, and the run ended "trainer-rank-1 died (exit code -9)", exit 1, as if
    the rank had crashed (torch had run the handler inside the collective and dropped its
    SystemExit). The signal's own exit instead; a rank that died by itself is still named."""
    from fleetrl import processes
    from fleetrl.app import rl
    from fleetrl.config import load_config
    from fleetrl.errors import FleetrlError

    def collective_fails(*args, **kwargs):
        raise RuntimeError("[gloo] Connection closed by peer")

    monkeypatch.setattr(rl, "train", collective_fails)
    run = rl.RLRun(load_config([], [("run.dir", str(tmp_path / "run"))]), log=lambda *_: None)
    rank = subprocess.Popen([sys.executable, "-c", "pass"])
    rank.wait()
    run.ranks, run.world, run.model_dir = [ManagedProcess("trainer-rank-1", rank, tmp_path / "rank-1.log")], None, None
    try:
        with pytest.raises(FleetrlError, match="^trainer-rank-1 died"):
            run.train()
        monkeypatch.setattr(processes, "_stop_signal", signal.SIGTERM)
        with pytest.raises(SystemExit) as stopped:
            run.train()
        assert stopped.value.code == 128 + signal.SIGTERM
        monkeypatch.setattr(processes, "_stop_signal", signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            run.train()
    finally:
        run.control.stop()


# A fleetrl whose trainer rank 1 prints a line and then ends by `how` (sys.argv[2]: SIGKILL, or
# an exit status), while its main thread waits (sys.argv[3] "hung": in a call that never returns,
# as in a gloo collective that missed the rank's death) or goes on ("stops": its own stop begins
# once it sees the death; "trains": it sees none) for three times the watch's grace, then exits 0.
RANK_ENDS = """
import sys, threading, time
from pathlib import Path
from fleetrl.app.rl import watch_ranks
from fleetrl.processes import at_forced_exit, start_process
how, main = sys.argv[2], sys.argv[3]
end = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)" if how == "SIGKILL" else f"raise SystemExit({how})"
rank = start_process("trainer-rank-1", [sys.executable, "-c", "print('rank 1 up', flush=True); " + end],
                     Path(sys.argv[1]))
stopped = threading.Event()
watch_ranks([rank], stopped, grace_s=1.0)
at_forced_exit(lambda: print("cleaned up", flush=True))
rank.popen.wait()
if main == "hung":
    threading.Event().wait()
if main == "stops":
    stopped.set()
time.sleep(3)
"""


def rank_ends(tmp_path, how: str, main: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RANK_ENDS, str(tmp_path / "rank-1.log"), how, main],
                          capture_output=True, text=True, timeout=120)


def test_a_dead_rank_the_main_thread_waits_on_ends_fleetrl_with_its_line(tmp_path):
    """gloo can miss a peer's death and wait out the collective's timeout (up to an hour), in a
    call nothing interrupts: a kill-point run hung 15 minutes so. The ranks' watch ends fleetrl
    after its grace with the line the main thread would have printed, last, its processes
    stopped and the forced exit's cleanups run."""
    fleetrl = rank_ends(tmp_path, "SIGKILL", "hung")
    assert fleetrl.returncode == 1, fleetrl.stderr
    assert fleetrl.stdout == "cleaned up\n"
    *why, error = fleetrl.stderr.strip().splitlines()
    assert error == f"fleetrl: error: trainer-rank-1 died (exit code -9); last lines of {tmp_path / 'rank-1.log'}: " \
                    "rank 1 up", fleetrl.stderr
    (line,) = why
    assert re.fullmatch(r"fleetrl: 1 s after trainer-rank-1 died, the main thread still waits in .*threading\.py:\d+ "
                        r"\(wait\) \(a collective that missed the death\): its processes are stopped", line), why


@pytest.mark.parametrize(("how", "main"), [("3", "stops"), ("0", "trains")])
def test_a_rank_the_main_thread_stops_for_or_that_finished_is_left_to_it(tmp_path, how, main):
    """A death the main thread stops for itself within the grace (its stop sets the watch's
    event), and a rank that exits 0 (its training done), are not the watch's to end."""
    fleetrl = rank_ends(tmp_path, how, main)
    assert fleetrl.returncode == 0 and fleetrl.stdout == "" and fleetrl.stderr == "", fleetrl.stderr
