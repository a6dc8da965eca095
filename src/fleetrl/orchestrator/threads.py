"""User code (rewards, environments' answers, tools) run off the event loop, with a time limit."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from fleetrl.envs import EnvError
from fleetrl.errors import FleetrlError, one_line

# Calls given up on (past their time limit) whose threads still run. Python cannot stop a
# thread, so each holds one until it returns; a reward that always hangs would leave one per
# sample, without end. Past this many the run ends instead, naming the last. Four times the
# rewards that run at once (rollouts.REWARD_THREADS): one stall of a remote judge that times
# out every reward of a batch, and then returns, does not end the run.
MAX_HUNG_CALLS = 128
_hung: dict[threading.Thread, str] = {}  # each with what it was called for, oldest first


class HungUserCode(FleetrlError):
    """Too many calls of user code still run past their time limits: the run ends."""


def _check_hung() -> None:
    for thread in [t for t in _hung if not t.is_alive()]:
        del _hung[thread]
    if len(_hung) >= MAX_HUNG_CALLS:
        raise HungUserCode(f"{len(_hung)} calls of user code still run past their time limits, each holding a "
                           f"thread that Python cannot stop (the last given up on: {list(_hung.values())[-1]}); fix "
                           f"what hangs in the environment")


async def call_user_code(where: str, limit_s: float, limit_name: str, fn: Callable, *args):
    """`fn(*args)` in a daemon thread of its own. What it raises, and a call past `limit_s`
    seconds (the setting `limit_name`), comes back as one `EnvError` beginning with `where`
    (an `EnvError` it raises itself passes as it is).

    A call past the limit is given up on, not stopped: Python cannot kill a thread, so a hung
    call's thread runs on (a daemon) until it returns or the process ends. With MAX_HUNG_CALLS
    such threads alive, the next call raises HungUserCode, which ends the run.
    """
    _check_hung()
    thread = None
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation that
        # arrives as the call completes, and the run could then not stop.
        async with asyncio.timeout(limit_s):
            future, thread = in_daemon_thread(fn, *args)
            return await future
    except TimeoutError:
        _hung[thread] = where
        raise EnvError(f"{where} took longer than {limit_name} = {limit_s:g} s") from None
    except EnvError:
        raise
    except Escaped as e:
        raise EnvError(f"{where} raised {e}") from e.__cause__
    except Exception as e:
        raise EnvError(f"{where} raised {one_line(e)}") from e


class Escaped(Exception):
    """A SystemExit or KeyboardInterrupt that user code raised (a `sys.exit()` in a reward, say),
    carried as an ordinary error. Left as it was, it would end the event loop that awaited it,
    the control loop of the whole run, and the run would hang."""

    def __init__(self, e: BaseException) -> None:
        super().__init__(one_line(e))
        self.__cause__ = e


def in_daemon_thread(fn: Callable, *args) -> tuple[asyncio.Future, threading.Thread]:
    """`fn(*args)` in a new daemon thread, as a future of the running event loop (and the thread).

    Not an executor's thread: Python cannot stop a thread, so a reward that never returns holds
    its thread until the process ends, and `concurrent.futures` joins its threads at exit, so
    fleetrl could never exit. A daemon thread given up on (the caller stopped waiting) is left
    to finish or to die with the process; its result is dropped.
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if future.done():  # cancelled: the caller stopped waiting
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def run() -> None:
        try:
            outcome = True, fn(*args)
        except Exception as e:  # the caller decides what an exception means
            outcome = False, e
        except BaseException as e:  # SystemExit, KeyboardInterrupt: see Escaped
            outcome = False, Escaped(e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    thread = threading.Thread(target=run, name="fleetrl-user-code", daemon=True)
    thread.start()
    return future, thread
