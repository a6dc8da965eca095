"""What every test run shares: no model hub, unit tests first, and where the time went."""

import os
import time
from collections import defaultdict

import pytest

# Nothing in the tests may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"

_module_seconds: dict[str, float] = defaultdict(float)
_module_outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_started = time.monotonic()


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


def pytest_terminal_summary(terminalreporter):
    if not _module_seconds:
        return
    write = terminalreporter.write_line
    terminalreporter.section("wall time per module")
    for module, seconds in sorted(_module_seconds.items(), key=lambda kv: -kv[1]):
        outcomes = ", ".join(f"{n} {o}" for o, n in sorted(_module_outcomes[module].items()))
        write(f"{seconds:8.1f} s  {module}  ({outcomes})")
    write(f"{sum(_module_seconds.values()):8.1f} s  in tests; {time.monotonic() - _started:.1f} s since the "
          "session started (collection included)")
