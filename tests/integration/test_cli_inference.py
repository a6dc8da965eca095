"""The README's main job, `fleetrl inference`, as a user runs it: a real vLLM CPU server."""

import signal
import time

from .conftest import alive_in, child_groups, fleetrl_process


def fleetrl(*args):
    return fleetrl_process("inference", *args)


def test_inference_samples_prints_and_leaves_no_process(tmp_path, model_dir):
    with fleetrl("--prompt", "What is 2 + 2?", "--orchestrator.max_tokens", "12", "--run.dir", str(tmp_path)) as proc:
        groups: set[int] = set()
        while proc.poll() is None:  # note the server's process group while it runs
            groups |= child_groups(proc.pid)
            time.sleep(0.5)
        out = proc.stdout.read()
    assert proc.returncode == 0, out
    assert "> What is 2 + 2?" in out and "versions v0@0" in out and "worker vllm-0" in out
    assert (tmp_path / "logs" / "vllm-0.log").exists()
    assert groups and not alive_in(groups)


def test_ctrl_c_during_startup_stops_the_servers(tmp_path, model_dir):
    with fleetrl("--run.dir", str(tmp_path)) as proc:
        deadline = time.monotonic() + 300
        while not (groups := child_groups(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert groups, "the server never started"
        time.sleep(5)  # let it spawn its engine core
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
        groups: set[int] = set()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            groups |= child_groups(proc.pid)
            if groups and len(alive_in(groups)) >= 3:  # API server, engine core, its worker
                break
            time.sleep(0.5)
        assert len(alive_in(groups)) >= 3, "the server never got its engine going"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while alive_in(groups) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive_in(groups)
