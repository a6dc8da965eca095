"""`fleetrl verify` on synthetic run directories: a good run passes, each violation is caught."""

import json

import pytest

from fleetrl.batch import Batch, Sample, batch_path
from fleetrl.config import load_config, to_toml
from fleetrl.versions import VersionSpan
from fleetrl.rundir import VerifyError, verify_run, write_manifest


def sample(spans):
    return Sample(prompt_ids=[1, 2], completion_ids=[3, 4, 5], inference_logprobs=[-1.0] * 3,
                  spans=[VersionSpan(v, s) for v, s in spans], reward=1.0, advantage=0.5, group=0)


def make_run(tmp_path, k=1, steps=3):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config([], [("orchestrator.max_off_policy_steps", str(k))])))
    lines = []
    for step in range(1, steps + 1):
        oldest = max(0, step - 1 - k)
        Batch(step, [sample([(oldest, 0), (step - 1, 2)])]).save(batch_path(run, step))
        lines.append({"step": step, "distance_max": (step - 1) - oldest,
                      "worker_versions": {"vllm-0": step, "vllm-1": step}})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (run / "logs").mkdir()
    (run / "logs" / "vllm-0.log").write_text("logs are not in the manifest")
    write_manifest(run)
    return run


def test_a_good_run_verifies(tmp_path):
    run = make_run(tmp_path)
    summary = verify_run(run)
    assert "3 steps, 3 trained samples, max off-policy distance 1 <= k = 1" in summary
    assert "2 worker(s) at the final version 3" in summary


def test_missing_manifest(tmp_path):
    run = make_run(tmp_path)
    (run / "manifest.json").unlink()
    with pytest.raises(VerifyError, match="no manifest.json"):
        verify_run(run)


def test_changed_artifact(tmp_path):
    run = make_run(tmp_path)
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + "\n")
    with pytest.raises(VerifyError, match="metrics.jsonl: sha256 differs"):
        verify_run(run)


def test_unlisted_artifact(tmp_path):
    run = make_run(tmp_path)
    (run / "extra.txt").write_text("x")
    with pytest.raises(VerifyError, match="extra.txt: an artifact the manifest does not list"):
        verify_run(run)


def test_step_over_the_bound(tmp_path):
    run = make_run(tmp_path)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines[1]["distance_max"] = 2
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    write_manifest(run)
    with pytest.raises(VerifyError, match="step 2: off-policy distance 2 > k = 1"):
        verify_run(run)


def test_sample_trained_over_the_bound_is_caught_from_its_spans(tmp_path):
    run = make_run(tmp_path)
    Batch(3, [sample([(0, 0)])]).save(batch_path(run, 3))  # metrics still claim distance 1
    write_manifest(run)
    with pytest.raises(VerifyError, match="step 3: sample 0 was trained at off-policy distance 2 > k = 1"):
        verify_run(run)


def test_worker_behind_the_final_version(tmp_path):
    run = make_run(tmp_path)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines[-1]["worker_versions"]["vllm-1"] = 2
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    write_manifest(run)
    with pytest.raises(VerifyError, match="worker vllm-1 ended at version 2, not the final version 3"):
        verify_run(run)
