"""`fleetrl rl` killed at each point of a step, then run again, on attached workers (issue 10,
items 8 and 13), packed into one sequence of runs on one vLLM server:

    run 1  SIGKILL mid-rollout of step 2
    run 2  SIGINT  mid-train of step 3
    run 3  SIGKILL mid-publish of v4: the worker left paused with an update open
    run 4  SIGTERM mid-checkpoint of step 4 (its metrics line written, the checkpoint not complete)
    run 5  trainer rank 1 SIGKILLed after checkpoint 4: one error line naming the rank
    run 6  finishes the run; its final model (RUN_DIR/final_model, equal to `fleetrl export` of
           the final checkpoint) is served by a plain vLLM server with the workers' logprobs,
           then scored by the quickstart's `fleetrl eval` on the run's server (riding on the
           deployment: no vLLM started for it), every token at the final version

Runs 5 and 6 resume in rolling mode (inference.publish = "rolling"): each publish is a wave.

Before them, on two such servers, the quickstart's attached run exactly as written (one trainer
rank, both servers), which the sequence's two ranks do not cover. The sequence attaches to the
first of the two only: a publish to one worker takes half the time of a publish to two, and each
of its runs publishes two or three times (the refit of what the last run left, the checkpoint's
version, its steps); the code that recovers a worker is the same for each worker.

Each run is the same command (two trainer ranks, FSDP2 over gloo) with a failpoint
(fleetrl/failpoints.py) that holds it where the signal must land. The server is started
here, as an operator would, so it outlives each run: every run attaches to what the previous
one left (at some version, or paused mid-update) and must recover it. After every signal
fleetrl and everything it started are gone within 10 s; in the end every step ran exactly once
(none twice, none missing), every sample was on-policy, and `fleetrl verify` passes. The
sequence is a module fixture; each check of what it left is a small test that reads it.
"""

import asyncio
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import httpx
import psutil
import torch

from fleetrl.app.checks import run_environments
from fleetrl.config import load_config
from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV
from fleetrl.envs.mix import run_task_stream
from fleetrl.failpoints import ENV as FAILPOINT_ENV
from fleetrl.inference.http import prompt_logprobs_of
from fleetrl.inference.vllm.admin import VllmAdminRoutes, VllmWorkerControl
from fleetrl.inference.vllm.data import VllmDataClient
from fleetrl.processes import free_port
from fleetrl.records import FenceEvent, RolloutRecord, StepLine
from fleetrl.rundir import RunDir
from fleetrl.trainer import checkpoint

from tests.documented import documented, run_documented

from .conftest import ROOT, TINY_ROLLOUTS, _term_with_parent, alive_in, child_groups, fleetrl_pid, read_metrics
from .deployments import ADMIN, DATA, OPERATOR_SERVERS, serving
from .runs import ATTACHED_RUN
from .test_conformance import check_no_prompt_lost_or_repeated

# Six runs of `fleetrl rl` in the sequence fixture: about 5 minutes here, more on a busy machine.
pytestmark = [pytest.mark.chaos, pytest.mark.deployment(OPERATOR_SERVERS), pytest.mark.timeout(1800)]

STEPS = 5
# Two environments, one run (orchestrator.envs): which one each prompt comes from is drawn by
# weight from the seed, so every resume of the sequence draws what the first run would have. The
# second is a data file's rows (env = "dataset": docs/examples.md's sums, the math reward), whose
# stream each resume skips to where the killed run was. Dynamic sampling: a pair of samples often
# scores alike (a sum: both wrong), and then one more prompt is sampled, at most; each step's
# window of the stream keeps the resumes exact.
SUMS = ROOT / "examples" / "math" / "sums.jsonl"
CONFIG = TINY_ROLLOUTS.replace('env = "reverse_text"', 'envs = [{name = "reverse", env = "reverse_text", weight = 2}, '
                               f'{{name = "sums", env = "dataset", options = {{path = "{SUMS}", reward = "math", '
                               'eval_fraction = 0.05}}]\ndynamic_sampling = true\n'
                               'dynamic_sampling_prompts = 3') + """
[inference]
request_timeout_s = 60
admin_timeout_s = 30
admin_retries = 1

[trainer]
world_size = 2
lr = 1e-5
checkpoint_interval = 1

[trainer.loss]
kl_coef = 0.01

[run]
max_steps = 5
"""


# The quickstart's commands this module runs as written (tests/documented.py): a run attached to
# two operator-started servers (deployments.py: SERVE), the final model exported and served, and
# scored on such a server. The sequence's runs add their own config to the same command line: not
# the documented command.
EXPORT = ".venv/bin/fleetrl export runs/default runs/default-step5 --step 5"
SERVE_FINAL = ("VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m "
               "vllm.entrypoints.openai.api_server --model runs/default/final_model --dtype float32 "
               "--max-model-len 512 --enforce-eager --port 8000")
EVAL = ".venv/bin/fleetrl eval runs/attached --inference.urls '[\"http://127.0.0.1:8001\"]' --eval.prompts 8"
CHAT = ("curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": "
        "\"runs/default/final_model\", \"messages\": [{\"role\": \"user\", \"content\": \"Reverse the text: fleet\"}], "
        "\"max_tokens\": 16}'")


# Runs 5 and 6 resume in rolling mode (issue 39): inference.publish is not run-defining, so a
# run switches by flag; with one worker each publish is one wave, its canary.
ROLLING = ("--inference.publish", "rolling")


class Run:
    """One `fleetrl rl` of the sequence, its output in its own log: the attached run with this
    module's config (fleetrl itself is the process: the signals reach it)."""

    def __init__(self, tmp_path, urls, name: str, failpoint: str | None = None, flags: tuple[str, ...] = ()) -> None:
        config = tmp_path / "rl.toml"
        config.write_text(CONFIG)
        self.log_path = tmp_path / f"{name}.log"
        env = {**os.environ, ADMIN_TOKEN_ENV: ADMIN, DATA_TOKEN_ENV: DATA}
        env.pop(FAILPOINT_ENV, None)
        if failpoint:
            env[FAILPOINT_ENV] = failpoint
        argv = [str(ROOT / ".venv" / "bin" / "fleetrl"), "rl", "@", str(ROOT / "configs" / "default.toml"), "@",
                str(config), "--inference.urls", json.dumps(urls), "--run.dir", str(tmp_path / "run"), *flags]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                         env=env, preexec_fn=_term_with_parent)
        self.groups: set[int] = set()

    @property
    def fleetrl(self) -> int:
        return fleetrl_pid(self.proc)

    def out(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, what: str, predicate, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.groups |= child_groups(self.fleetrl)
            if predicate():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"fleetrl rl exited ({self.proc.returncode}) waiting for {what}:\n{self.out()[-3000:]}")
            time.sleep(0.2)
        pytest.fail(f"timed out waiting for {what}:\n{self.out()[-3000:]}")

    def hold_at(self, failpoint: str) -> None:
        self.wait_for(f"failpoint {failpoint}", lambda: f"fleetrl: failpoint {failpoint} reached" in self.out())

    def signal(self, sig: int) -> float:
        """Send `sig`; seconds until fleetrl and every process it started were gone (<= 10)."""
        self.groups |= child_groups(self.fleetrl)
        assert self.fleetrl == self.proc.pid  # the signal goes to fleetrl itself
        assert len(self.groups) == 1, self.groups  # trainer rank 1: the servers are not fleetrl's
        sent = time.monotonic()
        self.proc.send_signal(sig)
        while (self.proc.poll() is None or alive_in(self.groups)) and time.monotonic() < sent + 10:
            time.sleep(0.05)
        gone = time.monotonic() - sent
        assert self.proc.poll() is not None and not alive_in(self.groups), \
            f"left 10 s after {signal.Signals(sig).name}: {alive_in(self.groups)}\n{self.out()[-3000:]}"
        return gone

    def finish(self, timeout_s: float = 900) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.groups |= child_groups(self.fleetrl)
            time.sleep(0.3)
        assert self.proc.poll() is not None, f"the run did not end in time:\n{self.out()[-3000:]}"
        assert not alive_in(self.groups)
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.fleetrl, signal.SIGKILL)  # make's fleetrl too, not make alone
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
            self.proc.kill()
            self.proc.wait()
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


def latest_checkpoint(run_dir) -> int | None:
    found = checkpoint.latest(run_dir / "checkpoints")
    return found[0] if found else None


def admin_of(url: str) -> VllmWorkerControl:
    # Looks only, as status does.
    return VllmWorkerControl(VllmAdminRoutes(url, url, ADMIN, timeout_s=30, retries=1, claim=None))


async def paused_and_versions(urls) -> list[tuple[bool, int | None]]:
    states = []
    for url in urls:
        admin = admin_of(url)
        try:
            states.append((await admin.is_paused(), await admin.version()))
        finally:
            await admin.close()
    return states


def test_the_quickstarts_attached_run_as_written(operator_servers, tmp_path):
    """docs/quickstart.md section 6 exactly as a user runs it: one trainer rank (the default), the
    tokens exported in the shell, only the run directory, the ports and the step count changed.
    Its trainer and the fleet's start once loaded the model at the same time and crashed on meta
    tensors (issue 25); the base weights now come from the trainer's own copy."""
    run_dir = tmp_path / "attached"
    done = run_documented(ATTACHED_RUN, "--run.max_steps", "1",
                          replace={"8001": operator_servers[0].rsplit(":", 1)[1],
                                   "8002": operator_servers[1].rsplit(":", 1)[1],
                                   "runs/attached": str(run_dir)},
                          env={ADMIN_TOKEN_ENV: ADMIN, DATA_TOKEN_ENV: DATA}, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "1 trainer rank(s)" in done.stdout
    assert [m.step for m in read_metrics(run_dir)] == [1]
    final = json.loads((run_dir / "final.json").read_text())
    assert sorted(final["workers"]) == sorted(operator_servers)
    assert all(w["version"] == 1 for w in final["workers"].values())
    verify = subprocess.run([sys.executable, "-m", "fleetrl", "verify", str(run_dir)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr


def test_the_readmes_status_of_any_fleet(operator_servers):
    """README's `fleetrl status --inference.urls ...` with the admin token exported, on a server
    the attached run above left at v1."""
    done = run_documented(".venv/bin/fleetrl status --inference.urls '[\"http://127.0.0.1:8000\"]'",
                          replace={"8000": operator_servers[0].rsplit(":", 1)[1]}, env={ADMIN_TOKEN_ENV: ADMIN},
                          timeout=120)
    assert done.returncode == 0, done.stderr
    (row,) = [line for line in done.stdout.splitlines() if line.startswith(operator_servers[0])]
    assert row.split()[1:4] == ["aggregated", "ready", "v1"], done.stdout


@dataclass(frozen=True)
class Sequence:
    """What the kill sequence left: the run's directory, the one server its runs attached to,
    and the seconds each signal took to leave no process."""

    run_dir: Path
    urls: list[str]
    gone: dict[str, float]

    def metrics(self) -> list[StepLine]:
        return read_metrics(self.run_dir)


@pytest.fixture(scope="module")
def sequence(operator_servers, tmp_path_factory) -> Sequence:
    """The six runs, each killed at its point (or left to finish), checked as they go: what a
    run must have left before the next one starts is asserted here; what the whole run left, by
    the tests below. Requested after the attached run above, which left the server at v1."""
    tmp_path = tmp_path_factory.mktemp("kill-points")
    run_dir, urls = tmp_path / "run", operator_servers[:1]
    gone: dict[str, float] = {}
    runs: list[Run] = []

    def start(name: str, failpoint: str | None = None, flags: tuple[str, ...] = ()) -> Run:
        runs.append(Run(tmp_path, urls, name, failpoint, flags))
        return runs[-1]

    try:
        run = start("1-rollout", "rollout:2")
        run.hold_at("rollout:2")
        # Step 2's rollouts start once v1 is published, while step 1 is still being checkpointed.
        run.wait_for("checkpoint 1", lambda: latest_checkpoint(run_dir) == 1)
        gone["SIGKILL mid-rollout"] = run.signal(signal.SIGKILL)
        assert [m.step for m in read_metrics(run_dir)] == [1] and latest_checkpoint(run_dir) == 1
        # The killed run left the worker at v1, the checkpoint's version: it is sent nothing.
        run = start("2-train", "train:3")
        run.hold_at("train:3")
        assert "resuming after step 1" in run.out()
        assert "ready at v1" in run.out() and "refitting it" not in run.out(), run.out()
        gone["SIGINT mid-train"] = run.signal(signal.SIGINT)
        assert run.proc.returncode == 130 and "fleetrl: interrupted" in run.out(), run.out()[-2000:]
        assert [m.step for m in read_metrics(run_dir)] == [1, 2] and latest_checkpoint(run_dir) == 2

        run = start("3-publish", "publish:4")
        run.hold_at("publish:4")
        gone["SIGKILL mid-publish"] = run.signal(signal.SIGKILL)
        assert [m.step for m in read_metrics(run_dir)] == [1, 2, 3] and latest_checkpoint(run_dir) == 3
        # Left paused, the update of v4 open (it never finished: it still reports v3).
        assert asyncio.run(paused_and_versions(urls)) == [(True, 3)]

        run = start("4-checkpoint", "checkpoint:4")
        run.hold_at("checkpoint:4")
        assert [m.step for m in read_metrics(run_dir)] == [1, 2, 3, 4]  # the line before the checkpoint
        gone["SIGTERM mid-checkpoint"] = run.signal(signal.SIGTERM)
        assert run.proc.returncode != 0
        assert latest_checkpoint(run_dir) == 3  # step 4's checkpoint never completed

        run = start("5-dead-rank", flags=ROLLING)
        run.wait_for("checkpoint 4", lambda: latest_checkpoint(run_dir) == 4)
        assert "resuming after step 3" in run.out()
        rank1 = next(iter(run.groups))
        os.kill(rank1, signal.SIGKILL)
        assert run.finish() == 1, run.out()[-3000:]
        error = [line for line in run.out().splitlines() if line.startswith("fleetrl: error:")]
        assert len(error) == 1 and "trainer-rank-1 died" in error[0], run.out()[-3000:]
        assert "Traceback" not in run.out()
        assert latest_checkpoint(run_dir) == 4

        run = start("6-finish", flags=ROLLING)
        assert run.finish() == 0, run.out()[-3000:]
        assert "resuming after step 4" in run.out()
    finally:
        for run in runs:
            run.stop()
    print("\nkill points: everything gone after " + ", ".join(f"{what} in {s:.1f} s" for what, s in gone.items()))
    return Sequence(run_dir, urls, gone)


def test_every_step_ran_once_and_no_prompt_was_lost_or_repeated(sequence):
    assert [m.step for m in sequence.metrics()] == list(range(1, STEPS + 1))  # none twice, none missing
    check_no_prompt_lost_or_repeated(sequence.run_dir, STEPS)  # the conformance suite's class (e)


def test_every_group_of_every_resume_is_the_uninterrupted_streams_task(sequence):
    check_every_group_is_the_uninterrupted_streams(sequence.run_dir)


def test_dynamic_sampling_drew_a_third_prompt_while_a_group_had_no_gradient(sequence):
    check_dynamic_sampling(sequence.run_dir, sequence.metrics())


def test_both_environments_were_sampled_and_reported_apart(sequence):
    done = sequence.metrics()
    assert set().union(*(m.batch.envs for m in done)) == {"reverse", "sums"}, [m.batch.envs for m in done]
    for m in done:
        assert sum(f.groups for f in m.batch.envs.values()) == m.batch.sampled_prompts
        assert {s.env for s in RunDir(sequence.run_dir).read_batch(m.step).samples} <= set(m.batch.envs)


def test_every_trained_sample_was_on_policy(sequence):
    assert all(m.update.max_off_policy == 0 and "misversioned" not in m.batch.dropped_by for m in sequence.metrics())


def test_the_kl_penalty_is_to_the_base_model_through_every_resume(sequence):
    """0 at v0, and after that as far as the policy moved (each step from 2 on is the first of a
    resumed run)."""
    done = sequence.metrics()
    assert done[0].update.ref_kl == pytest.approx(0.0, abs=1e-9)
    assert all(m.update.ref_kl > 0 for m in done[1:]) and done[0].update.grad_norm > 0, [m.update for m in done]


def test_the_runs_resumed_in_rolling_mode_published_in_canary_waves(sequence):
    """Runs 1-4 fenced every publish; runs 5 and 6, resumed with inference.publish = "rolling",
    published v4 and v5 (the run's last) each as one canary wave that the worker came out of
    ready; `fleetrl verify` and the checks above hold across the switch."""
    ends = [e for e in RunDir(sequence.run_dir).read_events() if isinstance(e, FenceEvent) and e.phase == "end"]
    first, last = {}, {e.version: e for e in ends}
    for e in ends:
        first.setdefault(e.version, e)
    assert all(first[v].wave is None for v in (1, 2, 3)), first
    for version in (4, 5):
        end = last[version]
        assert (end.wave, end.canary, end.ready) == (1, True, [sequence.urls[0]]), end


def test_the_last_resume_refitted_the_worker_to_the_checkpoints_version_first(sequence):
    batch5 = RunDir(sequence.run_dir).read_batch(5)
    assert batch5.meta.dispatch_version == 4
    assert all(span.version == 4 for s in batch5.samples for span in s.spans)


def test_the_worker_is_left_serving_the_final_version(sequence):
    done = sequence.metrics()
    final = json.loads((sequence.run_dir / "final.json").read_text())
    assert sorted(final["workers"]) == sequence.urls
    assert all(w["version"] == STEPS and w["checksum"] == done[-1].publish.checksum for w in final["workers"].values())
    assert asyncio.run(paused_and_versions(sequence.urls)) == [(False, STEPS)]


def test_fleetrl_verify_passes(sequence):
    verify = subprocess.run([sys.executable, "-m", "fleetrl", "verify", str(sequence.run_dir)], capture_output=True,
                            text=True)
    assert verify.returncode == 0, verify.stderr


def test_the_final_model_serves_like_the_workers(sequence, tmp_path):
    check_the_final_model_serves_like_the_workers(sequence.run_dir, sequence.urls, tmp_path)


def test_the_final_model_scores_on_the_runs_server(sequence):
    check_the_final_model_scores_on_the_runs_server(sequence.run_dir, sequence.urls)


def check_every_group_is_the_uninterrupted_streams(run_dir) -> None:
    """Every group of every step, sampled by a resumed run or not, is the task at its place in
    the run's seeded stream (step n's group g: task (n - 1) x W + g), the dynamic ones included:
    the dataset environment's rows, read from a memory-mapped table, come exactly as an
    uninterrupted run draws them."""
    config = load_config([run_dir / "config.toml"], [])
    window = config.orchestrator.prompts_per_step()
    stream = [drawn.id for drawn in itertools.islice(
        run_task_stream(run_environments(config, RunDir(run_dir)), config.run.seed), STEPS * window)]
    drawn = []
    for step in range(1, STEPS + 1):
        for line in RunDir(run_dir).rollouts_path(step).read_text().splitlines():
            record = json.loads(line)
            assert record["task"] == stream[(step - 1) * window + record["group"]], (step, record["group"], stream)
            drawn.append(record["task"])
    assert any(task.startswith("sums/row") for task in drawn), drawn


def check_dynamic_sampling(run_dir, metrics: list[StepLine]) -> None:
    """Dynamic sampling: each step sampled 2 prompts, and a third while one of them had no
    gradient; a group whose samples all scored alike was filtered (recorded, not trained) unless
    no group had a gradient; the step's figures of what was generated and what was trained are
    those of its records."""
    for m in metrics:
        records = RunDir(run_dir).read_rollouts(m.step)
        groups: dict[int, list[RolloutRecord]] = {}
        for r in records:
            groups.setdefault(r.group, []).append(r)
        # The rewards of each group's usable samples (those trained, or filtered as a group).
        rewards = {g: {r.reward for r in rs if r.drop_reason in (None, "filtered")} for g, rs in groups.items()}
        flat = {g for g, rs in rewards.items() if len(rs) == 1}
        gradient = {g for g, rs in rewards.items() if len(rs) > 1}
        filtered = {g for g, rs in groups.items() if all(r.drop_reason == "filtered" for r in rs)}
        assert m.batch.sampled_prompts == len(groups) and m.batch.filtered == len(filtered), m
        assert len(groups) == 2 + (not {0, 1} <= gradient), (m, rewards)
        assert filtered == (flat if gradient else set()), (rewards, filtered)
        trained = [r for r in records if r.trained]
        assert m.batch.trained.reward_mean == pytest.approx(sum(r.reward for r in trained) / len(trained))
        assert m.batch.dropped_by.get("filtered", 0) == sum(len(groups[g]) for g in filtered), m


def check_the_final_model_serves_like_the_workers(run_dir, workers, tmp_path) -> None:
    """What a user takes home, with the quickstart's commands: RUN_DIR/final_model has the same
    weights as `fleetrl export` of the final checkpoint; served by a plain vLLM server (the
    quickstart's `python -m vllm.entrypoints.openai.api_server`, no fleetrl code), it chats, and scores the agreement probe as the run's `workers` do at the final version."""
    from safetensors.torch import load_file

    paths = {"runs/default": str(run_dir)}
    export = run_documented(EXPORT, replace=paths)
    assert export.returncode == 0, export.stderr
    assert f"step {STEPS} of" in export.stdout
    exported, final_model = Path(f"{run_dir}-step5"), run_dir / "final_model"
    ours, theirs = load_file(final_model / "model.safetensors"), load_file(exported / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    probe = json.loads((run_dir / "final.json").read_text())["probe"]["token_ids"]
    port = str(free_port("127.0.0.1"))
    url = f"http://127.0.0.1:{port}"
    with serving(documented(SERVE_FINAL, replace={**paths, "8000": port}), url, tmp_path / "plain-vllm.log"):
        chat = run_documented(CHAT, replace={**paths, "8000": port}, timeout=120)
        assert chat.returncode == 0, chat.stderr
        reply = json.loads(chat.stdout)["choices"][0]["message"]
        assert reply["role"] == "assistant" and reply["content"], chat.stdout
        answer = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": str(final_model), "prompt": probe, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
        assert answer.status_code == 200, answer.text
        served = prompt_logprobs_of(probe, answer.json()["choices"][0]["prompt_logprobs"])

    async def workers_score() -> list[list[float]]:
        data = VllmDataClient(DATA, 120, run=None)  # scores only
        try:
            return [await data.prompt_logprobs(url, url, probe) for url in workers]
        finally:
            await data.close()

    for scored in asyncio.run(workers_score()):
        assert max(abs(a - b) for a, b in zip(served, scored, strict=True)) < 2e-3


def check_the_final_model_scores_on_the_runs_server(run_dir, workers) -> None:
    """The quickstart's `fleetrl eval` on the run: its config.toml the base, its final model scored
    on the run's own server on each environment's held-out prompts. The server carries the run's
    label, not the command's, so it is held to the model's weights first; then every token scored
    is of the final version, and the printed table is the records' figures."""
    (server,) = workers
    done = run_documented(EVAL, replace={"8001": server.rsplit(":", 1)[1], "runs/attached": str(run_dir)},
                          env={ADMIN_TOKEN_ENV: ADMIN, DATA_TOKEN_ENV: DATA}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"refitting it with the weights of v{STEPS}" in done.stderr, done.stderr[-3000:]
    out = RunDir(Path(f"{run_dir}-eval-v{STEPS}"))  # beside the run: `fleetrl verify` above still holds
    (line,) = out.read_evals()
    records = [json.loads(record) for record in out.eval_records_path(STEPS).read_text().splitlines()]
    assert line.version == STEPS and set(line.envs) == {"reverse", "sums"}
    assert records and all(r["worker"] == server and r["spans"] and {v for v, _ in r["spans"]} == {STEPS}
                           for r in records if r["completion_tokens"]), records
    header, *rows = [row.split() for row in done.stdout.strip().splitlines()]
    assert header == ["environment", "prompts", "completions", "reward_mean", "reward_se", "pass@1", "failed"], \
        done.stdout
    table = {row[0]: dict(zip(header[1:], row[1:])) for row in rows}
    assert set(table) == set(line.envs), done.stdout
    for env, row in table.items():
        mine = [r for r in records if r["env"] == env]
        rewards = [r["reward"] for r in mine if r["drop_reason"] is None]
        assert rewards, mine
        assert row == {"prompts": "8", "completions": str(len(mine)),
                       "reward_mean": f"{sum(rewards) / len(rewards):.3f}",
                       "reward_se": f"{statistics.stdev(rewards) / math.sqrt(len(rewards)):.3f}",  # 1 per prompt
                       "pass@1": f"{sum(r >= 1.0 for r in rewards) / len(rewards):.3f}",
                       "failed": str(len(mine) - len(rewards))}, (done.stdout, line)
