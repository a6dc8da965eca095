"""docs/examples.md's worked example as written (tests/documented.py), with one step of each
training command: the base model scored by `fleetrl eval`, a supervised warm start (`fleetrl
sft`, no inference worker), then GRPO from its final model on two environments, a JSONL dataset
with the `math` reward and reasoning-gym's basic_arithmetic, which evaluates the version it
starts from and its last on both; then `fleetrl verify`. The base model's evaluation and the
warm start are independent, so they run side by side; RL reads the warm start's model, verify
the RL run. They are one module fixture; each check is a small test that reads it."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fleetrl.rundir import RunDir

from tests.documented import run_documented

from .conftest import read_metrics
from .runs import RUNS

BASE_EVAL = ".venv/bin/fleetrl eval @ examples/math/rl.toml --out runs/math-base-eval"
SFT = ".venv/bin/fleetrl sft @ examples/math/sft.toml"
VERIFY = ".venv/bin/fleetrl verify runs/math-rl"
STEPS = 1  # of each training command: enough for an update, its publish and the last evaluation
HEADER = ["environment", "prompts", "completions", "reward_mean", "reward_se", "pass@1", "failed"]
ENVS = ["sums", "gym"]  # rl.toml's [[orchestrator.envs]]: the JSONL dataset, reasoning-gym's basic_arithmetic
EVAL_PROMPTS = 64  # rl.toml's eval.prompts, per environment


@dataclass(frozen=True)
class Example:
    root: Path
    base_eval: subprocess.CompletedProcess
    sft: subprocess.CompletedProcess
    rl: subprocess.CompletedProcess
    verify: subprocess.CompletedProcess

    def dir(self, name: str) -> Path:
        return self.root / name


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Example:
    root = tmp_path_factory.mktemp("math-example")
    steps = ("--run.max_steps", str(STEPS))
    with ThreadPoolExecutor(2) as pool:
        base_eval = pool.submit(run_documented, BASE_EVAL, replace={"runs/math-base-eval": str(root / "base-eval")},
                                timeout=600)
        sft = pool.submit(run_documented, SFT, "--run.dir", str(root / "sft"), *steps, timeout=600)
        base_eval, sft = base_eval.result(), sft.result()
    rl = run_documented(RUNS["math-example"].command, "--run.dir", str(root / "rl"), *steps,
                        replace={"runs/math-sft": str(root / "sft")}, timeout=900)
    verify = run_documented(VERIFY, replace={"runs/math-rl": str(root / "rl")})
    return Example(root, base_eval, sft, rl, verify)


def test_the_base_model_is_scored_with_mean_and_standard_error(example):
    done = example.base_eval
    assert done.returncode == 0, done.stderr[-3000:]
    header, *rows = [row.split() for row in done.stdout.strip().splitlines()]
    assert header == HEADER, done.stdout
    (line,) = RunDir(example.dir("base-eval")).read_evals()
    assert line.version == 0 and list(line.envs) == ENVS, line
    assert all(f.prompts == EVAL_PROMPTS and f.reward_se is not None for f in line.envs.values()), line
    assert rows == [[name, str(EVAL_PROMPTS), str(EVAL_PROMPTS), f"{f.reward_mean:.3f}", f"{f.reward_se:.3f}",
                     f"{f.pass_at[1]:.3f}", str(f.failed)] for name, f in line.envs.items()], done.stdout


def test_the_sft_runs_final_model_is_what_the_rl_runs_workers_sampled_at_v0(example, base_weights):
    """Step 1's samples, all of v0, scored by the SFT run's final model in transformers: the
    workers' logprobs are its own, and not the base model's."""
    from transformers import AutoModelForCausalLM

    from fleetrl.trainer.model import prompt_logprobs

    assert example.sft.returncode == 0, example.sft.stdout[-3000:] + example.sft.stderr[-3000:]
    assert example.rl.returncode == 0, example.rl.stdout[-3000:] + example.rl.stderr[-3000:]
    sft = AutoModelForCausalLM.from_pretrained(example.dir("sft") / "final_model", dtype=torch.float32).eval()
    batch = json.loads((example.dir("rl") / "batches" / "step_000001.json").read_text())
    samples = [s for s in batch["samples"] if s["completion_ids"]][:4]
    assert samples and all(span["version"] == 0 for s in samples for span in s["spans"])

    def gap(model) -> float:
        scored = [prompt_logprobs(model, s["prompt_ids"] + s["completion_ids"], torch.device("cpu"))
                  [-len(s["completion_ids"]):] for s in samples]
        return max(abs(a - b) for s, mine in zip(samples, scored) for a, b in zip(mine, s["inference_logprobs"]))

    assert gap(sft) < 1e-3 < gap(base_weights)


def test_step_1_trains_on_both_environments(example):
    """The batch step 1 trained holds groups of each environment, the reasoning-gym one included,
    each sample with trained tokens and a reward in [0, 1]."""
    assert example.rl.returncode == 0, example.rl.stdout[-3000:] + example.rl.stderr[-3000:]
    batch = json.loads((example.dir("rl") / "batches" / "step_000001.json").read_text())
    by_env = {name: [s for s in batch["samples"] if s["env"] == name] for name in ENVS}
    assert set(s["env"] for s in batch["samples"]) == set(ENVS), batch["samples"][0]
    for name, samples in by_env.items():
        assert any(s["completion_ids"] for s in samples), name
        assert all(s["loss_mask"] is None and 0 <= s["reward"] <= 1 for s in samples), name


def test_the_rl_run_evaluates_the_warm_start_and_its_last_version_on_both(example):
    rl = example.rl
    evals = RunDir(example.dir("rl")).read_evals()
    assert [e.version for e in evals] == [0, STEPS], evals
    for e in evals:
        assert list(e.envs) == ENVS, e
        for f in e.envs.values():
            assert f.prompts == EVAL_PROMPTS and f.reward_mean is not None and f.reward_se is not None, e
        # the log line: each environment's mean ± standard error
        figures = r" reward \d\.\d{3} ± \d\.\d{3} pass@1 \d\.\d{3}"
        line = rf"fleetrl: evaluated v{e.version} in [\d.]+ s: sums{figures}, gym{figures}"
        assert re.search(line, rl.stdout + rl.stderr), rl.stdout[-3000:] + rl.stderr[-3000:]
    metrics = read_metrics(example.dir("rl"))
    assert [m.step for m in metrics] == list(range(1, STEPS + 1))
    assert all(m.update.mismatch_kl is not None and m.update.mismatch_kl <= 1e-6 for m in metrics), metrics


def test_the_rl_run_passes_verify(example):
    assert example.verify.returncode == 0, example.verify.stdout + example.verify.stderr
    assert "artifacts match the manifest" in example.verify.stdout
