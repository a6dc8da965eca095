"""The reward menu: how an environment judges a completion against its task's answer. Every reward
is a function `(completion: str, answer, **options) -> float` in [0, 1], compared against the
answer as its text (`answer_text`); `resolve_reward(spec, **options)` gives the one `spec` names
(`exact`, `contains`, `regex`, `math`, or a user's `module.path:function`) with its options bound.
`math` runs math-verify in a worker process killed past `timeout_s` (MATH_TIMEOUT_S). What each
one scores, and why `math` runs out of process: docs/environments.md, "Rewards"."""

from __future__ import annotations

import functools
import inspect
import json
import re
import select
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetrl.envs.base import EnvError
from fleetrl.envs.imports import load_attribute
from fleetrl.processes import start_piped

Reward = Callable[[str, Any], float]
# The `math` reward's time limit per call (option timeout_s), well within the orchestrator's
# reward_timeout_s (30 s by default), which also covers a worker's start (MATH_START_S at most).
MATH_TIMEOUT_S = 5.0
MATH_START_S = 20.0
# The most math-verify worker processes at once (each some 100 MB); more calls wait for one.
MATH_WORKERS = 4


def answer_text(answer: Any) -> str:
    """The text an answer is compared as: `str(answer)`, stripped, but an integral float as the
    integer (7.0 as `7`: a JSON column that holds 7 beside 2.5 loads 7 as 7.0)."""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer).strip()


def exact(completion: str, answer: Any) -> float:
    return float(completion.strip() == answer_text(answer))


def contains(completion: str, answer: Any) -> float:
    needle = answer_text(answer)
    return float(bool(needle) and needle in completion)


def regex(completion: str, answer: Any, pattern: str) -> float:
    found = re.findall(pattern, completion)  # one group: the group's text of each match
    return float(bool(found) and found[-1].strip() == answer_text(answer))


def math_equal(completion: str, answer: Any, timeout_s: float = MATH_TIMEOUT_S) -> float:
    """math-verify's judgement, in a worker process (fleetrl.envs.math_worker) killed past
    `timeout_s`: its parse of a completion can run sympy's big integers for ever, holding the
    GIL, which no thread's time limit stops and which would starve the orchestrator's loop."""
    return _MATH_WORKERS.score(completion, answer_text(answer), timeout_s)


class _MathWorkers:
    """Up to MATH_WORKERS worker processes, each lent to one call at a time; one that overran
    its call's limit or died is killed and forgotten, and another starts when next needed."""

    def __init__(self) -> None:
        self._idle: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MATH_WORKERS)

    def score(self, completion: str, answer: str, timeout_s: float) -> float:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            try:
                worker = worker or self._start()
                reply = self._ask(worker, json.dumps([completion, answer]), timeout_s)
            except BaseException:
                if worker is not None:
                    _end(worker)
                raise
            with self._lock:
                self._idle.append(worker)
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["score"]

    @staticmethod
    def _start() -> subprocess.Popen:
        worker = start_piped([sys.executable, "-I", str(Path(__file__).with_name("math_worker.py"))])
        try:
            if _read_line(worker, MATH_START_S) != "ready":
                raise RuntimeError("math-verify's worker process did not start")
        except BaseException:
            _end(worker)
            raise
        return worker

    @staticmethod
    def _ask(worker: subprocess.Popen, request: str, timeout_s: float) -> dict:
        worker.stdin.write(request + "\n")
        worker.stdin.flush()
        reply = _read_line(worker, timeout_s)
        if reply is None:
            # Not a TimeoutError: call_user_code would take that for its own limit's.
            raise RuntimeError(f"math-verify took longer than timeout_s = {timeout_s:g} s (its process was killed)")
        return json.loads(reply)


def _read_line(worker: subprocess.Popen, timeout_s: float) -> str | None:
    """The worker's next line, None past `timeout_s`; a RuntimeError if it ended."""
    if not select.select([worker.stdout], [], [], timeout_s)[0]:
        return None
    line = worker.stdout.readline()  # the worker writes whole lines
    if not line:
        raise RuntimeError(f"math-verify's worker process ended (exit code {worker.wait()})")
    return line.strip()


def _end(worker: subprocess.Popen) -> None:
    worker.kill()
    worker.wait()
    worker.stdin.close()
    worker.stdout.close()


_MATH_WORKERS = _MathWorkers()


MENU: dict[str, Callable[..., float]] = {"exact": exact, "contains": contains, "regex": regex, "math": math_equal}


def resolve_reward(spec: str, **options: Any) -> Reward:
    """The reward `spec` names (a MENU name or `module.path:function`), with `options` bound;
    an EnvError of one line for an unknown name, a function that cannot be imported, or options
    its signature does not take."""
    where = f"reward {spec}"
    if spec in MENU:
        fn = MENU[spec]
    elif ":" in spec:
        fn = load_attribute(where, *spec.split(":", 1))
    else:
        raise EnvError(f"unknown reward '{spec}' (the menu: {', '.join(MENU)}; or module.path:function)")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): its first call checks the options
        signature = None
    if signature is not None:
        try:
            signature.bind("completion", "answer", **options)
        except TypeError as e:
            takes = ", ".join(name if p.default is p.empty else f"{name}={p.default!r}"
                              for name, p in signature.parameters.items())
            raise EnvError(f"{where}: {e} (it takes {takes})") from None
    if fn is regex:
        _check_pattern(options["pattern"], where)
    if fn is math_equal and not _is_seconds(timeout_s := options.get("timeout_s", MATH_TIMEOUT_S)):
        raise EnvError(f"{where}: timeout_s = {timeout_s!r} is not a positive number of seconds")
    return functools.partial(fn, **options) if options else fn


def _is_seconds(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")


def _check_pattern(pattern: Any, where: str) -> None:
    try:
        groups = re.compile(pattern).groups
    except (re.error, TypeError) as e:
        raise EnvError(f"{where}: pattern {pattern!r} is not a regular expression ({e})") from None
    if groups != 1:
        raise EnvError(f"{where}: pattern {pattern!r} has {groups} groups; it needs exactly one, the answer")
