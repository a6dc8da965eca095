"""Every command of README.md, docs/quickstart.md and docs/environments.md is run by some test,
as written (tests/documented.py)."""

import ast

import pytest

from tests.documented import NOT_RUN_BY_A_TEST, ROOT, documented, documented_commands, page_commands


def commands_in_integration_tests() -> set[str]:
    """The string literals of the integration tests that are documented commands: each reaches
    `documented(...)` (which refuses any change but paths, ports and the step count) on its way
    to being run."""
    commands = set(documented_commands())
    found = set()
    for path in (ROOT / "tests" / "integration").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in commands:
                found.add(node.value)
    return found


def test_every_documented_command_is_run_by_a_test():
    commands = documented_commands()
    assert len(commands) >= 12 and "make run" in commands
    assert [c for c in commands if c not in commands_in_integration_tests()] == []
    assert "make test" in page_commands(ROOT / "README.md") and "make test" in NOT_RUN_BY_A_TEST


def test_a_documented_command_is_run_as_written_with_the_tests_additions():
    assert documented("make run", "--run.dir", "/tmp/x y") == "exec make run ARGS='--run.dir '\"'\"'/tmp/x y'\"'\"''"
    assert documented('make run ARGS="--run.max_steps 15"', "--run.max_steps", "5") == \
        "exec make run ARGS='--run.max_steps 15 --run.max_steps 5'"
    serve = next(c for c in documented_commands() if "--model runs/default/final_model" in c)
    line = documented(serve, replace={"runs/default": "/tmp/run", "8000": "9001"})
    assert line.startswith("VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 exec .venv/bin/python -m "
                           "vllm.entrypoints.openai.api_server --model /tmp/run/final_model")
    assert line.endswith("--port 9001")


@pytest.mark.parametrize("extra", [
    ("@", "tests/rl.toml"),
    ("--trainer.world_size", "2"),
    ("--inference.workers", "2"),
    ("--orchestrator.max_off_policy_steps", "0"),
    ("--run.max_steps",),
])
def test_an_argument_that_changes_the_code_path_is_refused(extra):
    with pytest.raises(ValueError, match="runs as written: a test may add only"):
        documented("make run", *extra)


@pytest.mark.parametrize("old, new", [(".venv/bin/fleetrl", "torchrun -m fleetrl"), ("dynamo", "vllm"),
                                      ("8001", "--inference.workers 2"), ("512", "4096"), ("8001", "3")])
def test_a_replacement_other_than_a_port_or_a_path_is_refused(old, new):
    """A port is a number from 1024 on: a model length or a step count cannot pass for one."""
    attached = next(c for c in documented_commands() if "--inference.urls" in c)
    dynamo = next(c for c in documented_commands() if "--inference.provider dynamo" in c)
    with pytest.raises(ValueError, match="may replace only ports and runs/ paths"):
        documented(attached if old == "8001" else dynamo, replace={old: new})
