"""What every test run shares: no model hub, imports without the garbage collector, unit tests
first, where the time and the memory went, and a bounded disk."""

import os
import shutil
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

from fleetrl.heavy_imports import imports_without_gc
from tests.tmp_folders import KEPT_FOLDERS

# Nothing in the tests may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"

_module_seconds: dict[str, float] = defaultdict(float)
_module_outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_module_after: dict[str, str] = {}  # the runner's memory and its descendants when the module ended
_started = time.monotonic()

_BASETEMP = pytest.StashKey[Path]()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The test modules' imports (torch, transformers, vLLM) with the garbage collector paused
    and what they made frozen after, as fleetrl's own processes import them
    (fleetrl/heavy_imports.py)."""
    with imports_without_gc():
        return (yield)


@pytest.fixture(scope="session", autouse=True)
def _basetemp(request, tmp_path_factory) -> None:
    request.config.stash[_BASETEMP] = tmp_path_factory.getbasetemp()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Unit tests first, so a unit failure fails fast (`-x`) before any server starts; the
    order within each part is the one collection gave (a module's fleets stay together)."""
    items.sort(key=lambda item: "tests/unit/" not in item.path.as_posix())


def pytest_runtest_logreport(report):
    """Each module's wall time: its tests' setup, call and teardown (its module and session
    fixtures' time counts to the module whose test started or ended them)."""
    module = report.nodeid.split("::", 1)[0]
    _module_seconds[module] += report.duration
    if report.when == "call" or report.outcome != "passed":
        _module_outcomes[module][report.outcome] += 1


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Once a module's last test and its fixtures have ended, the folders it made under the base
    temp are deleted, unless one of its tests failed. A run keeps checkpoints of 1.6 GB each, and
    a whole suite's runs add up to 11-22 GB, more than a CI machine may have free.
    (pytest itself deletes a passed test's tmp_path: tmp_path_retention_policy in pyproject.)"""
    module = item.nodeid.split("::", 1)[0]
    if nextitem is not None and nextitem.nodeid.split("::", 1)[0] == module:
        return
    _module_after[module] = _memory_and_descendants()
    basetemp = item.config.stash.get(_BASETEMP, None)
    if basetemp is not None and basetemp.is_dir():
        made = {path for path in basetemp.iterdir() if path not in KEPT_FOLDERS}
        if _module_outcomes[module].get("failed"):
            KEPT_FOLDERS.update(made)
        else:
            for path in made:
                path.unlink() if path.is_symlink() else shutil.rmtree(path, ignore_errors=True)


def _memory_and_descendants() -> str:
    """The runner's resident memory and the processes still below it: a suite that grows or
    leaves a busy process behind slows every module after it (a CI run was killed for memory)."""
    me = psutil.Process()
    alive = []
    for child in me.children(recursive=True):
        try:
            # A zombie has ended (its CPU seconds stay as they were) but was not reaped: said so.
            ended = " (ended, not reaped)" if child.status() == psutil.STATUS_ZOMBIE else ""
            alive.append((child.pid, child.name(), f"{sum(child.cpu_times()[:2]):.0f} s CPU{ended}"))
        except psutil.NoSuchProcess:
            pass
    named = ", ".join(f"{name}[{pid}] {cpu}" for pid, name, cpu in alive[:6])
    return f"rss {me.memory_info().rss / 2**30:.1f} GiB, {len(alive)} descendants{': ' + named if named else ''}"


def pytest_terminal_summary(terminalreporter):
    if not _module_seconds:
        return
    write = terminalreporter.write_line
    terminalreporter.section("wall time per module")
    for module, seconds in sorted(_module_seconds.items(), key=lambda kv: -kv[1]):
        outcomes = ", ".join(f"{n} {o}" for o, n in sorted(_module_outcomes[module].items()))
        write(f"{seconds:8.1f} s  {module}  ({outcomes})  after it: {_module_after.get(module, '?')}")
    write(f"{sum(_module_seconds.values()):8.1f} s  in tests; {time.monotonic() - _started:.1f} s since the "
          "session started (collection included)")
