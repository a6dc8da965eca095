"""The README's commands that start no training run, as written: `fleetrl inference` on a real
vLLM CPU server, the resolved config, the help; docs/environments.md's dry runs of its examples,
named by import path; and `fleetrl inference` stopped by Ctrl-C and by SIGKILL, where a
process-level property is cheapest to check."""

import re
import signal
import time

import psutil
import pytest

from tests.documented import documented, run_documented

from .conftest import ENGINE_CORE, alive_in, child_groups, fleetrl_process


def fleetrl(*args):
    return fleetrl_process("inference", *args)


def test_inference_samples_prints_and_leaves_no_process(tmp_path, model_dir):
    shell = documented('.venv/bin/fleetrl inference --prompt "Hi!"', "--run.dir", str(tmp_path))
    with fleetrl_process(shell=shell) as proc:
        groups: set[int] = set()
        while proc.poll() is None:  # note the server's process group while it runs
            groups |= child_groups(proc.pid)
            time.sleep(0.5)
        out = proc.stdout.read()
    assert proc.returncode == 0, out
    assert "> Hi!" in out and "versions v0@0" in out and "worker vllm-0" in out
    assert (tmp_path / "logs" / "vllm-0.log").exists()
    assert groups and not alive_in(groups)



def test_the_readmes_dry_run_prints_the_default_config_and_starts_nothing():
    done = run_documented(".venv/bin/fleetrl rl --dry-run")
    assert done.returncode == 0, done.stderr
    assert "[inference]" in done.stdout and 'provider = "vllm"' in done.stdout and "[trainer]" in done.stdout


# docs/environments.md's commands: each example of examples/my_envs/ loaded from the repository
# root by a console script (whose sys.path holds no current directory of its own) and checked.
ENVIRONMENT_DRY_RUNS = (
    ".venv/bin/fleetrl rl @ configs/default.toml --orchestrator.env examples.my_envs.shout:Shout --dry-run",
    ".venv/bin/fleetrl rl @ configs/default.toml --orchestrator.env examples.my_envs.guess:Guess "
    "--orchestrator.env_options '{high = 20}' --dry-run",
    ".venv/bin/fleetrl rl @ configs/default.toml --orchestrator.env examples.my_envs.weather:Weather "
    "--orchestrator.max_turns 3 --orchestrator.max_tokens 40 --dry-run",
    ".venv/bin/fleetrl rl @ configs/default.toml --orchestrator.env dataset --orchestrator.env_options "
    "'{path = \"examples/math/sums.jsonl\", reward = \"math\", eval_fraction = 0.05}' --dry-run",
)


@pytest.mark.parametrize("command", ENVIRONMENT_DRY_RUNS)
def test_the_environment_pages_dry_runs_load_its_examples(command):
    done = run_documented(command)
    assert done.returncode == 0, done.stderr
    (env,) = re.findall(r"--orchestrator.env (\S+)", command)
    assert f'env = "{env}"' in done.stdout


def test_the_readmes_help_lists_every_command():
    done = run_documented(".venv/bin/python -m fleetrl --help")
    assert done.returncode == 0, done.stderr
    for command in ("rl", "inference", "status", "verify", "plot", "export", "model", "bench"):
        assert f"\n    {command}" in done.stdout, command


def engine_core_started(proc, timeout_s: float) -> set[int]:
    """The process groups of fleetrl's servers once one holds its engine core (the model runs in
    it: config/vllm.py), by name: a process counted alone may be a passing one (a compiler, a
    probe of what the CPU can run) that has gone by the time it is looked at again."""
    deadline = time.monotonic() + timeout_s
    groups: set[int] = set()
    while time.monotonic() < deadline:
        groups |= child_groups(proc.pid)
        if any(name_of(pid) == ENGINE_CORE for pid in alive_in(groups)):
            return groups
        time.sleep(0.2)
    pytest.fail(f"no server of fleetrl's started its engine core in {timeout_s:g} s: {alive_in(groups)}")


def name_of(pid: int) -> str | None:
    try:
        return psutil.Process(pid).name()
    except psutil.NoSuchProcess:
        return None


def test_ctrl_c_during_startup_stops_the_servers(tmp_path, model_dir):
    with fleetrl("--run.dir", str(tmp_path)) as proc:
        groups = engine_core_started(proc, 300)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "fleetrl: interrupted" in out
    deadline = time.monotonic() + 30
    while alive_in(groups) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive_in(groups)


def test_servers_die_with_a_killed_fleetrl(tmp_path, model_dir):
    """SIGKILL leaves fleetrl no chance to clean up: its servers, engine cores included, must
    notice on their own and end."""
    with fleetrl("--run.dir", str(tmp_path)) as proc:
        groups = engine_core_started(proc, 600)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while alive_in(groups) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive_in(groups)
