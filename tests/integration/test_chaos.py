"""Faults against a real `fleetrl rl` (issue 10), several packed into one run where that is
sound, to keep CI time flat (tests/integration/runs.py lists the three runs):

1. a worker hung (SIGSTOP of its whole process group: server and engine core) is detected
   within a bounded time, leaves the publish fence, and the run goes on with the other;
2. the hung worker is restarted (inference.max_restarts) with the zero LoRA adapter every
   launched worker starts from, refitted with the trained adapter, and readmitted;
3. SIGTERM of `fleetrl rl` (one trainer rank: every process starts on the control loop's
   thread) leaves no process behind within 10 s;
4. the run's task is a user's multi-turn environment, the examples' Guess named by its import
   path (`examples.my_envs.guess:Guess`, docs/environments.md): every episode's turns carry
   their spans;

and the quickstart's Dynamo command as written, SIGKILLed in its second step, once it has
trained one: the frontend, the worker and its engine-core grandchildren end by themselves
within 10 s; and a LoRA run on fleetrl's Dynamo worker kind whose worker is SIGKILLed after its
first step (2 trainer ranks): the replacement is admitted once it serves the adapter, refitted
with the trained one, and the run ends as it would have.
(Resuming after a kill at every point of a step, SIGINT, and two trainer ranks:
test_kill_points.py.)

Every assertion on samples is the version promise: no trained sample is off-policy beyond k
or misversioned.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from fleetrl.rundir import RunDir

from tests.documented import documented

from .conftest import (ROOT, TINY_ROLLOUTS, _term_with_parent, adapter_bytes, alive_in, check_adapter_folders_trained,
                       check_episodes, child_groups, read_metrics)
from .runs import RUNS

pytestmark = pytest.mark.chaos

CONFIG = TINY_ROLLOUTS.replace('env = "reverse_text"', 'env = "examples.my_envs.guess:Guess"\nmax_turns = 2') + """
[inference]
workers = 2
request_timeout_s = 45
health_timeout_s = 3
admin_timeout_s = 15
admin_retries = 1
discovery_interval_s = 2

[inference.vllm]
max_model_len = 512

[trainer]
lr = 1e-5
checkpoint_interval = 2

[trainer.lora]
rank = 8

[run]
# A bound, not the length: SIGTERM ends the run once the restarted worker serves. Steps whose
# groups all score alike train nothing and take seconds, and 10 of them once ended the run while
# the replacement was still starting, before the test could see it readmitted.
max_steps = 200
"""


def start_rl(tmp_path, log_name, shell: str | None = None):
    """`fleetrl rl` on CONFIG, or the documented command line `shell` (bash execs it: the
    process started is fleetrl's own)."""
    if shell:
        argv = ["bash", "-c", shell]
    else:
        config = tmp_path / "rl.toml"
        config.write_text(CONFIG)
        argv = [sys.executable, "-m", "fleetrl", "rl", "@", str(config), "--run.dir", str(tmp_path / "run")]
    with open(tmp_path / log_name, "w") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                preexec_fn=_term_with_parent)


def wait_until(proc, what, predicate, timeout_s, log_path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        if proc.poll() is not None:
            pytest.fail(f"fleetrl rl exited ({proc.returncode}) while waiting for {what}: "
                        f"{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}: {log_path.read_text()[-3000:]}")


def stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_hung_worker_restarted_then_sigterm(tmp_path):
    run_dir, log_path = tmp_path / "run", tmp_path / "first.log"
    proc = start_rl(tmp_path, "first.log")
    groups: set[int] = set()
    try:
        wait_until(proc, "step 1", lambda: read_metrics(run_dir), 600, log_path)
        groups = child_groups(proc.pid)
        assert len(groups) == 2, groups  # the two vLLM servers (one rank: no trainer child)
        hung = min(groups)
        os.killpg(hung, signal.SIGSTOP)
        stopped_at = time.monotonic()
        detected_at = wait_until(proc, "the hung worker to be found dead",
                                 lambda: " is dead: " in log_path.read_text(), 120, log_path)
        # Logged once the replacement answers /health (a vLLM start on a loaded machine).
        restarted_at = wait_until(proc, "the hung worker to be restarted",
                                  lambda: " restarted (" in log_path.read_text(), 600, log_path)
        # A step is published without it meanwhile, then it is refitted and serves again.
        steps_before = len(read_metrics(run_dir))
        readmitted_at = wait_until(proc, "the restarted worker to be readmitted",
                                   lambda: len(read_metrics(run_dir)) > steps_before
                                   and len(read_metrics(run_dir)[-1].worker_versions) == 2, 600, log_path)
        assert any(len(m.worker_versions) == 1 for m in read_metrics(run_dir)), read_metrics(run_dir)
        assert not alive_in({hung})  # the hung process group was killed, not left stopped
        groups |= child_groups(proc.pid)
        proc.send_signal(signal.SIGTERM)
        terminated_at = time.monotonic()
        while (alive_in(groups) or proc.poll() is None) and time.monotonic() < terminated_at + 10:
            time.sleep(0.1)
        gone_after = time.monotonic() - terminated_at
        assert proc.poll() is not None and not alive_in(groups), f"left 10 s after SIGTERM: {alive_in(groups)}"
    finally:
        stop(proc)
        for group in groups:  # nothing may outlive the test, even when it failed
            try:
                os.killpg(group, signal.SIGCONT)
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"\nchaos: hung worker detected after {detected_at - stopped_at:.1f} s, restarted "
          f"{restarted_at - detected_at:.1f} s later, serving again {readmitted_at - restarted_at:.1f} s after "
          f"its restart; all processes gone {gone_after:.1f} s after SIGTERM")
    assert proc.returncode != 0
    done = read_metrics(run_dir)
    assert [m.step for m in done] == list(range(1, len(done) + 1))
    assert all(m.update.max_off_policy == 0 and "misversioned" not in m.batch.dropped_by for m in done)
    check_episodes(run_dir, len(done), max_turns=2)
    records = [r for step in range(1, len(done) + 1) for r in RunDir(run_dir).read_rollouts(step)]
    assert {r.env for r in records} == {"examples.my_envs.guess:Guess"}
    assert any(m["content"] in ("No: higher.", "No: lower.") for r in records for m in r.messages or [])  # its hints
    # The readmitted worker was refitted with the adapter alone (verified on every rank, or it
    # would not be at the step's version), as every publish sends it. (Whether its adapter moved
    # off zero is not checked here: this task's tiny rollouts may score every group alike.)
    assert list(done[-1].publish.received_bytes.values()) == [adapter_bytes(run_dir)] * 2


def test_the_quickstarts_dynamo_run_then_sigkill_leaves_no_process(tmp_path):
    """The quickstart's Dynamo command as written trains a step (its publish paused the worker in
    wait mode while the next step's rollouts ran, k = 1); then SIGKILL in the second step, which
    leaves fleetrl no chance to clean up: the Dynamo frontend dies with it (the kernel's parent-death
    signal), the worker takes its process group, engine core included, down with it
    (engine/orphan.py)."""
    log_path, run_dir = tmp_path / "dynamo.log", tmp_path / "dynamo"
    shell = documented(RUNS["dynamo"].command, "--run.max_steps", "3", replace={"runs/dynamo": str(run_dir)})
    proc = start_rl(tmp_path, "dynamo.log", shell)
    groups: set[int] = set()
    try:
        wait_until(proc, "step 1", lambda: len(read_metrics(run_dir)) >= 1, 900, log_path)
        groups = child_groups(proc.pid)
        assert len(groups) == 2, groups  # the frontend and the worker, each leading its group
        assert len(alive_in(groups)) >= 3, alive_in(groups)  # and the worker's engine core
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        while alive_in(groups) and time.monotonic() < killed_at + 10:
            time.sleep(0.1)
        gone_after = time.monotonic() - killed_at
        assert not alive_in(groups), f"left 10 s after SIGKILL: {alive_in(groups)}"
    finally:
        stop(proc)
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"\nchaos: Dynamo frontend, worker and engine core gone {gone_after:.1f} s after SIGKILL of fleetrl rl")
    done = read_metrics(run_dir)
    assert [m.step for m in done[:1]] == [1] and "1 trainer rank(s), env reverse_text" in log_path.read_text()
    assert all(m.update.max_off_policy <= 1 and "misversioned" not in m.batch.dropped_by for m in done)
    assert list(done[0].worker_versions.values()) == [1]  # Dynamo's one worker, at v1 after step 1


def test_a_dynamo_lora_worker_killed_is_replaced_and_serves_the_trained_adapter(tmp_path):
    """LoRA on fleetrl's Dynamo worker kind (abort pauses, its default there), trained on 2 ranks
    (the adapter sharded by FSDP2): the worker's whole process group SIGKILLed once step 1 is trained; the replacement starts from a zero adapter,
    is admitted once /engine/load_lora named its folder and a request through the adapter was
    served, is refitted with the trained adapter, and serves the rest of the run."""
    run_dir, log_path = tmp_path / "dynamo-lora", tmp_path / "dynamo-lora.log"
    proc = start_rl(tmp_path, "dynamo-lora.log", RUNS["dynamo-lora"].command.replace("runs/dynamo-lora", str(run_dir)))
    groups: set[int] = set()
    try:
        wait_until(proc, "step 1", lambda: len(read_metrics(run_dir)) >= 1, 600, log_path)
        groups = child_groups(proc.pid)
        (worker,) = [g for g in groups if "dynamo_worker" in " ".join(psutil.Process(g).cmdline())]
        os.killpg(worker, signal.SIGKILL)
        # Logged once the frontend lists the replacement (a Dynamo worker's start on a loaded machine).
        wait_until(proc, "the killed worker to be replaced", lambda: " restarted (" in log_path.read_text(), 600,
                   log_path)
        assert proc.wait(timeout=600) == 0, log_path.read_text()[-3000:]
    finally:
        stop(proc)
        groups |= child_groups(proc.pid) if proc.poll() is None else set()
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    done = read_metrics(run_dir)
    assert [m.step for m in done] == [1, 2, 3] and "2 trainer rank(s)" in log_path.read_text()
    assert all(m.update.max_off_policy <= 1 and "misversioned" not in m.batch.dropped_by for m in done)
    # Sampled through the adapter the trainer had at each version, the replacement's samples included.
    assert all(m.update.mismatch_kl <= 1e-6 for m in done), [m.update.mismatch_kl for m in done]
    first, last = done[0].worker_versions, done[-1].worker_versions
    assert len(first) == len(last) == 1 and first.keys() != last.keys()  # a new instance after the kill
    assert list(done[-1].publish.received_bytes.values()) == [adapter_bytes(run_dir)]
    assert list(last.values()) == [3]
    folders = sorted(run_dir.rglob("dynamo-worker-*-adapter"))
    assert len(folders) == 2
    check_adapter_folders_trained(folders[1:])  # the replacement's
    verify = subprocess.run([sys.executable, "-m", "fleetrl", "verify", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
