"""The commands of docs/quickstart.md, as the tests run them.

Every command on that page (each line of its ```bash blocks) is run by a test through
`documented(...)`, with the test's own arguments added and its own paths and ports put in;
tests/unit/test_quickstart.py checks that each one is. So a command renamed, a flag dropped or
a path moved breaks a test, not a new user's first hour.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"
# Leading NAME=value assignments of a command line (the environment it runs with).
ASSIGNMENTS = re.compile(r"^((?:[A-Z_][A-Z0-9_]*=\S+\s+)*)(.*)$", re.DOTALL)


def quickstart_commands() -> list[str]:
    commands, in_bash = [], False
    for line in QUICKSTART.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
        elif in_bash and line.strip():
            commands.append(line.strip())
    return commands


def documented(command: str, *extra: str, replace: dict[str, str] | None = None) -> str:
    """The quickstart's `command` as one bash line to run from the repository root: each key of
    `replace` replaced by its value (a path, a port), `extra` appended (inside ARGS="..." for
    `make run`), and the command exec'd by bash, so the process started is the command's own."""
    assert command in quickstart_commands(), f"not a command of {QUICKSTART.name}: {command}"
    for old, new in (replace or {}).items():
        assert old in command, (old, command)
        command = command.replace(old, new)
    added = " ".join(shlex.quote(arg) for arg in extra)
    if command.startswith("make run") and extra:
        quoted = re.search(r'ARGS="([^"]*)"', command)
        args = f"{quoted.group(1)} {added}" if quoted else added
        command = f"make run ARGS={shlex.quote(args)}"
    elif extra:
        command = f"{command} {added}"
    assignments, rest = ASSIGNMENTS.match(command).groups()
    return f"{assignments}exec {rest}"
