"""Every command of docs/quickstart.md is run by some test (through tests/documented.py)."""

import ast

from tests.documented import ROOT, documented, quickstart_commands


def commands_in_integration_tests() -> set[str]:
    """The string literals of the integration tests that are quickstart commands: each reaches
    `documented(...)` (which refuses any other) on its way to being run."""
    commands = set(quickstart_commands())
    found = set()
    for path in (ROOT / "tests" / "integration").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in commands:
                found.add(node.value)
    return found


def test_every_quickstart_command_is_run_by_a_test():
    documented_commands = quickstart_commands()
    assert len(documented_commands) >= 10
    run = commands_in_integration_tests()
    assert [c for c in documented_commands if c not in run] == []


def test_a_documented_command_is_run_as_written_with_the_tests_additions():
    assert documented("make run", "--run.dir", "/tmp/x y") == "exec make run ARGS='--run.dir '\"'\"'/tmp/x y'\"'\"''"
    assert documented('make run ARGS="--run.max_steps 15"', "--run.max_steps", "5") == \
        "exec make run ARGS='--run.max_steps 15 --run.max_steps 5'"
    serve = next(c for c in quickstart_commands() if "--model runs/default/final_model" in c)
    line = documented(serve, replace={"runs/default": "/tmp/run", "8000": "9001"})
    assert line.startswith("VLLM_CPU_KVCACHE_SPACE=1 exec .venv/bin/python -m vllm.entrypoints.openai.api_server "
                           "--model /tmp/run/final_model")
    assert line.endswith("--port 9001")
