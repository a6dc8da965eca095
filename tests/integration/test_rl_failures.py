"""`fleetrl rl` when a trainer rank dies: the run ends with one line naming the rank, no
process is left, the last good checkpoint is intact, and the same command resumes from it
with the fleet refitted to the checkpoint's version before any rollout."""

import json
import os
import signal
import subprocess
import sys
import time

from fleetrl.trainer import checkpoint

from .conftest import alive_in, child_groups, fleetrl_process

CONFIG = """
[inference]
workers = 1

[inference.vllm]
max_model_len = 512

[orchestrator]
env = "arithmetic"
batch_prompts = 2
group_size = 2
max_tokens = 12
max_off_policy_steps = 0

[trainer]
world_size = 2
lr = 1e-5
checkpoint_interval = 2

[run]
max_steps = 4
"""


def start(tmp_path):
    config = tmp_path / "rl.toml"
    config.write_text(CONFIG)
    return fleetrl_process("rl", "@", str(config), "--run.dir", str(tmp_path / "run"))


def rank1_pid(parent: int) -> int | None:
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    for line in out.splitlines()[1:]:
        pid, ppid, args = line.split(None, 2)
        if int(ppid) == parent and "fleetrl.trainer" in args:
            return int(pid)
    return None


def test_dead_rank_ends_the_run_cleanly_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    with start(tmp_path) as proc:
        groups: set[int] = set()
        killed = False
        deadline = time.monotonic() + 1200
        while proc.poll() is None and time.monotonic() < deadline:
            groups |= child_groups(proc.pid)
            if not killed and checkpoint.latest(run_dir / "checkpoints"):
                os.kill(rank1_pid(proc.pid), signal.SIGKILL)
                killed = True
            time.sleep(0.3)
        out = proc.stdout.read()
    assert killed, out[-3000:]
    assert proc.returncode == 1, out[-3000:]
    error = [line for line in out.splitlines() if line.startswith("fleetrl: error:")]
    assert len(error) == 1 and "trainer-rank-1 died" in error[0], out[-3000:]
    assert "Traceback" not in out
    assert not alive_in(groups)
    assert checkpoint.latest(run_dir / "checkpoints")[0] == 2

    # The same command resumes after step 2, refitting the fleet to v2 first.
    with start(tmp_path) as proc:
        out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, out[-3000:]
    assert "resuming after step 2" in out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    batch3 = json.loads((run_dir / "batches" / "step_000003.json").read_text())
    assert batch3["meta"]["dispatch_version"] == 2
    assert all(span["version"] == 2 for s in batch3["samples"] for span in s["spans"])
    verify = subprocess.run([sys.executable, "-m", "fleetrl", "verify", str(run_dir)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
