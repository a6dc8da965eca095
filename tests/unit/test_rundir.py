"""`fleetrl verify` on synthetic run directories: a good run passes, each violation is caught."""

import json

import pytest

from fleetrl.batch import Batch, Sample
from fleetrl.config import load_config, to_toml
from fleetrl.errors import FleetrlError
from fleetrl.rundir import RunDir, VerifyError, step_name, step_of, verify_run
from fleetrl.versions import VersionSpan


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
        RunDir(run).write_batch(Batch(step, [sample([(oldest, 0), (step - 1, 2)])]))
        lines.append({"step": step, "distance_max": (step - 1) - oldest,
                      "worker_versions": {"vllm-0": step, "vllm-1": step}})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (run / "logs").mkdir()
    (run / "logs" / "vllm-0.log").write_text("logs are not in the manifest")
    RunDir(run).write_manifest()
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
    RunDir(run).write_manifest()
    with pytest.raises(VerifyError, match="step 2: off-policy distance 2 > k = 1"):
        verify_run(run)


def test_sample_trained_over_the_bound_is_caught_from_its_spans(tmp_path):
    run = make_run(tmp_path)
    RunDir(run).write_batch(Batch(3, [sample([(0, 0)])]))  # metrics still claim distance 1
    RunDir(run).write_manifest()
    with pytest.raises(VerifyError, match="step 3: sample 0 was trained at off-policy distance 2 > k = 1"):
        verify_run(run)


def test_worker_behind_the_final_version(tmp_path):
    run = make_run(tmp_path)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines[-1]["worker_versions"]["vllm-1"] = 2
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    RunDir(run).write_manifest()
    with pytest.raises(VerifyError, match="worker vllm-1 ended at version 2, not the final version 3"):
        verify_run(run)


def test_step_names_round_trip():
    assert step_name(3) == "step_000003"
    assert [step_of(f"{step_name(12)}{suffix}") for suffix in ("", ".json", ".jsonl")] == [12, 12, 12]
    with pytest.raises(ValueError):
        step_of(".tmp-step_000004")


def test_a_resumed_run_drops_the_steps_after_its_checkpoint(tmp_path):
    run = RunDir(make_run(tmp_path))
    run.write_rollouts(3, [{"step": 3}])
    config = load_config([run.config_path], [])
    run.start(config, resume=2)
    assert [m["step"] for m in run.read_metrics()] == [1, 2]
    assert sorted(p.name for p in run.batches_dir.iterdir()) == [step_name(1) + ".json", step_name(2) + ".json"]
    assert not run.rollouts_path(3).exists() and not run.manifest_path.exists()


def test_a_finished_run_without_a_checkpoint_is_not_overwritten(tmp_path):
    run = RunDir(make_run(tmp_path))
    with pytest.raises(FleetrlError, match="holds a run without a checkpoint to resume from"):
        run.start(load_config([run.config_path], []), resume=0)
