"""The commands of README.md, docs/quickstart.md, docs/environments.md and docs/examples.md, as
the tests run them: as written.

Every command in those pages (each line of their ```bash blocks) is run by a test through
`documented(...)`; tests/unit/test_quickstart.py checks that each one is. A test may change only
what makes a command fit a test, never its code path:

- `replace`: a port by another port, a path under `runs/` by another path;
- `extra`: `--run.dir PATH`, `--run.max_steps N`, and `--port N` (a server's port).

Anything else — a config file, the world size, the workers, the provider, the environment, k —
would run another command than the page's, and is refused here. So a command renamed, a flag
dropped or a path moved breaks a test, not a new user's first hour; and a command the suite
cannot afford as written is changed on the page, not in the test.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "docs" / "quickstart.md", ROOT / "docs" / "environments.md",
         ROOT / "docs" / "examples.md")
# Run by CI itself (.ci/run), not by a test of the suite it starts.
NOT_RUN_BY_A_TEST = {"make test": "CI runs it (.ci/run): a test of the suite cannot run the suite"}
# Leading NAME=value assignments of a command line (the environment it runs with).
ASSIGNMENTS = re.compile(r"^((?:[A-Z_][A-Z0-9_]*=\S+\s+)*)(.*)$", re.DOTALL)
# The flags a test may add, each with one value: where output goes, how long it runs, its port.
ALLOWED_EXTRA = {"--run.dir", "--run.max_steps", "--port"}


def page_commands(page: Path) -> list[str]:
    """Each line of the page's ```bash blocks, without a trailing `# comment`."""
    commands, in_bash = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash"
        elif in_bash and line.strip():
            commands.append(re.sub(r"\s+#\s.*$", "", line.strip()))
    return commands


def documented_commands() -> list[str]:
    """Every command of PAGES that a test runs, once each."""
    seen: dict[str, None] = {}
    for page in PAGES:
        seen.update(dict.fromkeys(c for c in page_commands(page) if c not in NOT_RUN_BY_A_TEST))
    return list(seen)


def check_extra(extra: tuple[str, ...]) -> None:
    """Refuses any added argument but the allowed flags, each with its one value."""
    pairs = list(zip(extra[::2], extra[1::2]))
    if len(extra) % 2 or any(flag not in ALLOWED_EXTRA for flag, _ in pairs):
        raise ValueError(f"a documented command runs as written: a test may add only {sorted(ALLOWED_EXTRA)}, "
                         f"each with a value, not {list(extra)}")


def check_replace(old: str, new: str) -> None:
    """Refuses any replacement but a port by a port and a `runs/` path by a path. A port is a
    number from 1024 on, so a step count or a model length cannot pass for one."""
    port = all(p.isascii() and p.isdigit() and 1024 <= int(p) <= 65535 for p in (old, new))
    path = old.startswith("runs/") and "/" in new and not new.startswith("-")
    if not (port or path):
        raise ValueError(f"a documented command runs as written: a test may replace only ports and runs/ paths, "
                         f"not {old!r} by {new!r}")


def documented(command: str, *extra: str, replace: dict[str, str] | None = None) -> str:
    """The documented `command` as one bash line to run from the repository root: each key of
    `replace` replaced by its value, `extra` appended (inside ARGS="..." for `make run`), and the
    command exec'd by bash, so the process started is the command's own."""
    assert command in documented_commands(), f"not a command of {', '.join(p.name for p in PAGES)}: {command}"
    check_extra(extra)
    for old, new in (replace or {}).items():
        check_replace(old, new)
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


def run_documented(command: str, *extra: str, replace: dict[str, str] | None = None, env: dict[str, str] | None = None,
                   timeout: float = 300) -> subprocess.CompletedProcess:
    """`documented(command, *extra, replace=replace)` run to its end from the repository root,
    as from a user's shell with `env` exported too; its output captured as text."""
    return subprocess.run(["bash", "-c", documented(command, *extra, replace=replace)], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)
