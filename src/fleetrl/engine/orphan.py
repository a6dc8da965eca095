"""Worker processes that take their whole process group down when fleetrl dies.

A vLLM engine core (and its workers) are grandchildren of fleetrl: a kernel parent-death
signal (PR_SET_PDEATHSIG) on the server or Dynamo worker that fleetrl started would end that
process alone and leave the engine running — seen when fleetrl was OOM-killed, and with
Dynamo workers after a SIGKILL of `fleetrl rl`. fleetrl starts each such process as the leader
of its own process group (setsid), and the process watches its parent: once the parent is gone,
the whole group is killed, engine included.
"""

import os
import signal
import threading
import time

POLL_S = 0.5


def _kill_group_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os.killpg(0, signal.SIGKILL)


def die_with_parent() -> None:
    """From now on, this process group is killed within POLL_S of this process's parent dying."""
    threading.Thread(target=_kill_group_when_orphaned, args=(os.getppid(),), daemon=True,
                     name="fleetrl-orphan-watch").start()
