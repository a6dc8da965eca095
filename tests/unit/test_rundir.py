"""`fleetrl verify` on synthetic run directories: a good run passes, each violation is caught."""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from fleetrl import files
from fleetrl.batch import Batch, Sample
from fleetrl.config import load_config, to_toml
from fleetrl.errors import FleetrlError
from fleetrl.files import atomic_write
from fleetrl.app.rl import final_generation
from fleetrl.inference.fleet import AgreementProbe, Fleet
from fleetrl.records import FenceEvent, FinalProbe, FinalWorker, RecordError, RolloutRecord, SampleEvent
from fleetrl.rundir import RunDir, VerifyError, step_name, step_of, verify_run
from fleetrl.versions import VersionSpan

from .fake_fleet import FakeProvider
from .step_lines import step_dict, step_line
from .test_orchestrator import Tokenizer


def sample(spans):
    return Sample(prompt_ids=[1, 2], completion_ids=[3, 4, 5], inference_logprobs=[-1.0] * 3,
                  spans=[VersionSpan(v, s) for v, s in spans], reward=1.0, advantage=0.5, group=0)


def rollout(step, group, trained):
    return RolloutRecord(step=step, group=group, task=f"t{group}", env="fake", completion="x", reward=1.0,
                         advantage=0.5, worker="vllm-0", completion_tokens=3, prefill_worker=None, spans=[[0, 0]],
                         distance=0, trained=trained, drop_reason=None if trained else "empty", reward_error=None,
                         version_error=None)


def make_run(tmp_path, k=1, steps=3):
    """A finished run of `steps` steps, each of one group of 4 samples (the default group size),
    one of them trained."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config([], [("orchestrator.max_off_policy_steps", str(k))])))
    lines = []
    for step in range(1, steps + 1):
        oldest = max(0, step - 1 - k)
        RunDir(run).write_batch(Batch(step, [sample([(oldest, 0), (step - 1, 2)])]))
        RunDir(run).write_rollouts(step, [rollout(step, 0, trained=i == 0) for i in range(4)])
        lines.append(step_dict(step, update={"max_off_policy": (step - 1) - oldest},
                               worker_versions={"vllm-0": step, "vllm-1": step}))
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
    lines[1]["update"]["max_off_policy"] = 2
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


def test_a_group_of_another_size_than_the_configured_one_is_refused(tmp_path):
    """A worker's answer with an extra choice once trained as a group of 5 at group size 4, and
    the run verified. Every group sampled, trained or dropped, is counted (its rollouts)."""
    run = make_run(tmp_path)
    RunDir(run).write_rollouts(2, [rollout(2, group, trained=i == 0) for group, size in ((0, 4), (1, 5))
                                   for i in range(size)])
    RunDir(run).write_manifest()
    with pytest.raises(VerifyError, match=r"^step 2: group 1 holds 5 samples, not orchestrator.group_size = 4$"):
        verify_run(run)
    RunDir(run).write_rollouts(2, [rollout(2, 0, trained=True)] * 3)
    RunDir(run).write_manifest()
    with pytest.raises(VerifyError, match=r"^step 2: group 0 holds 3 samples, not orchestrator.group_size = 4$"):
        verify_run(run)
    RunDir(run).rollouts_path(2).unlink()
    RunDir(run).write_manifest()
    with pytest.raises(VerifyError, match=r"^step 2: no rollouts \(.*step_000002.jsonl\)$"):
        verify_run(run)


def test_step_names_round_trip():
    assert step_name(3) == "step_000003"
    assert [step_of(f"{step_name(12)}{suffix}") for suffix in ("", ".json", ".jsonl")] == [12, 12, 12]
    with pytest.raises(ValueError):
        step_of(".tmp-step_000004")


def test_a_resumed_run_drops_the_steps_after_its_checkpoint(tmp_path):
    run = RunDir(make_run(tmp_path))
    run.write_rollouts(3, [])
    config = load_config([run.config_path], [])
    run.start(config, resume=2)
    assert [m.step for m in run.read_metrics()] == [1, 2]
    assert sorted(p.name for p in run.batches_dir.iterdir()) == [step_name(1) + ".json", step_name(2) + ".json"]
    assert not run.rollouts_path(3).exists()
    run.close()


def test_a_resumed_finished_run_keeps_its_final_model_and_manifest_until_replaced(tmp_path):
    """Before, the resume deleted both as it started: a resume that then failed (a worker that
    never came up) left a finished run without its final model, unable to verify."""
    run = RunDir(make_run(tmp_path))
    run.final_model_dir.mkdir()
    (run.final_model_dir / "model.safetensors").write_bytes(b"v3")
    manifest = run.manifest_path.read_bytes()
    run.start(load_config([run.config_path], []), resume=3)
    assert (run.final_model_dir / "model.safetensors").read_bytes() == b"v3"
    assert run.manifest_path.read_bytes() == manifest

    def write(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"v5")

    assert run.replace_final_model(write) == run.final_model_dir
    assert (run.final_model_dir / "model.safetensors").read_bytes() == b"v5"
    assert not [p for p in run.root.iterdir() if p.name.startswith(".") and p.name != ".lock"]
    run.close()


def test_a_final_model_left_between_the_two_renames_is_kept(tmp_path):
    """A run killed after the old final model was moved aside and before the new one was moved
    in left only `.old-final_model`; the next swap deleted it as a leftover, and a write that
    then failed left the run without any final model."""
    run = RunDir(tmp_path)
    (tmp_path / ".old-final_model").mkdir()
    (tmp_path / ".old-final_model" / "model.safetensors").write_bytes(b"v3")

    def fails(folder):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run.replace_final_model(fails)
    assert (run.final_model_dir / "model.safetensors").read_bytes() == b"v3"


def test_a_resume_drops_a_torn_last_event(tmp_path):
    """A kill mid-append tore the timeline's last line; appended after, it became a damaged
    middle line, and `fleetrl plot` and the run's finish failed on it."""
    run = RunDir(make_run(tmp_path))
    run.append_event(FenceEvent(phase="start", version=3))
    assert len(run.read_events()) == 1  # on disk: the kill comes after it
    with open(run.events_path, "a") as f:
        f.write('{"t": 1, "event": "fen')
    warnings = []
    run.log = warnings.append
    run.start(load_config([run.config_path], []), resume=3)
    run.append_event(FenceEvent(phase="start", version=4))
    assert [e.version for e in run.read_events()] == [3, 4]
    assert any("torn" in line for line in warnings)
    run.close()


@pytest.mark.parametrize("where", ["folder", "cwd"])
def test_a_folder_that_holds_no_run_is_refused_and_left_as_it_was(tmp_path, monkeypatch, where):
    """`--run.dir ""` (the current folder), or any folder with files but no config.toml: a
    start once cleaned it up as a run (final_model/, manifest.json, step_* files)."""
    (tmp_path / "manifest.json").write_text("mine")
    (tmp_path / "batches").mkdir()
    (tmp_path / "batches" / "step_000001.json").write_text("mine too")
    if where == "cwd":
        monkeypatch.chdir(tmp_path)
    run = RunDir(tmp_path if where == "folder" else Path(""))
    with pytest.raises(FleetrlError, match=r"is not empty and holds no fleetrl run \(no config.toml\)"):
        run.start(load_config([], []), resume=0)
    assert (tmp_path / "manifest.json").read_text() == "mine"
    assert (tmp_path / "batches" / "step_000001.json").read_text() == "mine too"


def test_a_folder_with_a_config_toml_of_its_own_is_refused_and_left_as_it_was(tmp_path):
    """A project's folder with its own config.toml passed for a run directory, and a start
    rewrote it and cleaned up its step_* files (issue 27, item 10)."""
    (tmp_path / "config.toml").write_text('[tool.black]\nline-length = 100\n')
    (tmp_path / "batches").mkdir()
    (tmp_path / "batches" / "step_000001.json").write_text("mine")
    with pytest.raises(FleetrlError, match=r"is not empty and holds no fleetrl run \(its config.toml is not a fleetrl "
                                           r"config: unknown config key 'tool'"):
        RunDir(tmp_path).start(load_config([], []), resume=0)
    assert (tmp_path / "config.toml").read_text() == '[tool.black]\nline-length = 100\n'
    assert (tmp_path / "batches" / "step_000001.json").read_text() == "mine"
    # One that a fleetrl config loads from (empty, say) but that no start of fleetrl's wrote.
    (tmp_path / "config.toml").write_text("# my notes\n")
    with pytest.raises(FleetrlError, match=r"holds no fleetrl run \(a config.toml but no metrics.jsonl beside it"):
        RunDir(tmp_path).start(load_config([], []), resume=0)
    assert (tmp_path / "config.toml").read_text() == "# my notes\n" and not (tmp_path / "metrics.jsonl").exists()
    # A run's own directory, started again before its first step finished, is still its own.
    run_dir = tmp_path / "run"
    run = RunDir(run_dir)
    run.start(load_config([], []), resume=0)
    run.close()
    again = RunDir(run_dir)
    again.start(load_config([], []), resume=0)
    again.close()


def test_a_resume_keeps_the_runs_id_and_a_run_from_before_ids_were_kept_gets_one_written_once(tmp_path):
    """The run id (what its workers' labels and claims name) is drawn for a run's first start and
    read back by every resume (issue 36, item 2). A run an older fleetrl left has none: the fleet
    is built, labelling the workers, before the start, which then writes that same one, once.
    The file is no artifact: a finished run whose resume fails still matches its manifest."""
    run = RunDir(make_run(tmp_path))
    drawn = run.run_id()
    assert not run.run_id_path.exists() and RunDir(run.root).run_id() != drawn  # nothing kept yet
    run.start(load_config([run.config_path], []), resume=3)
    run.close()
    assert run.run_id_path.read_text() == drawn + "\n"
    assert verify_run(run.root)
    written = run.run_id_path.stat().st_ino
    resumed = RunDir(run.root)
    assert resumed.run_id() == drawn
    resumed.start(load_config([run.config_path], []), resume=2)
    resumed.close()
    assert resumed.run_id() == drawn and run.run_id_path.stat().st_ino == written  # not written again


def test_a_run_id_file_that_holds_no_run_id_is_refused_naming_it(tmp_path):
    run = RunDir(make_run(tmp_path))
    run.run_id_path.write_text("v3@other\n")
    with pytest.raises(FleetrlError, match=rf"^{re.escape(str(run.run_id_path))}: 'v3@other' is not a run id"):
        run.start(load_config([run.config_path], []), resume=3)


def test_a_finished_run_without_a_checkpoint_is_not_overwritten(tmp_path):
    run = RunDir(make_run(tmp_path))
    with pytest.raises(FleetrlError, match="holds a run without a checkpoint to resume from"):
        run.start(load_config([run.config_path], []), resume=0)


# -- one run at a time --------------------------------------------------------------------------

HOLD = """
import sys
from fleetrl.config import load_config
from fleetrl.rundir import RunDir
RunDir(sys.argv[1]).start(load_config([], []), resume=0)
print("locked", flush=True)
sys.stdin.read()  # holds the run directory until the test ends this process
"""


def test_a_second_run_on_the_same_directory_is_refused_naming_the_first_ones_pid(tmp_path):
    run = RunDir(tmp_path / "run")
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(run.root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout.readline() == "locked\n"
        with pytest.raises(FleetrlError, match=rf"^run.dir {run.root} is in use by fleetrl pid {first.pid}; "):
            run.start(load_config([], []), resume=0)
    finally:
        first.kill()  # dies without a word: the kernel lets go of its lock
        first.wait()
    run.start(load_config([], []), resume=0)
    run.close()


def test_the_step_to_resume_from_is_read_only_once_the_directory_is_locked(tmp_path, monkeypatch):
    """`fleetrl rl` once picked its checkpoint before it held the directory, so another run
    could add one under the decision; now a directory in use is refused before any is read."""
    from fleetrl.app import rl

    root = tmp_path / "run"
    read = []
    monkeypatch.setattr(rl.checkpoint, "latest", lambda *args, **kwargs: read.append(args))
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    run = None
    try:
        assert first.stdout.readline() == "locked\n"
        run = rl.RLRun(load_config([], [("run.dir", str(root))]), log=lambda *_: None)
        with pytest.raises(FleetrlError, match=rf"^run.dir {root} is in use by fleetrl pid {first.pid}; "):
            rl.find_resume(run.run_dir)
        assert read == []
    finally:
        first.kill()
        first.wait()
        if run is not None:
            run.control.stop()
    resume = rl.find_resume(run.run_dir)  # free now: it holds the directory, then reads
    assert len(read) == 1 and resume == 0
    run.run_dir.close()


def test_close_lets_go_of_the_directory(tmp_path):
    run, other = RunDir(tmp_path / "run"), RunDir(tmp_path / "run")
    run.start(load_config([], []), resume=0)
    with pytest.raises(FleetrlError, match=rf"in use by fleetrl pid {os.getpid()}"):
        other.start(load_config([], []), resume=0)
    run.close()
    other.start(load_config([], []), resume=0)
    other.close()
    assert run.lock_path.exists() and run.lock_path not in run.artifacts()  # never in the manifest


# -- a resume keeps what the run means ----------------------------------------------------------

def contents(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("field, value, message", [
    ("orchestrator.env", "arithmetic", "orchestrator.env 'arithmetic' but the run was started with 'reverse_text'"),
    ("orchestrator.env_options", "{max_len = 8}", "orchestrator.env_options {'max_len': 8} but the run was started with {}"),
    ("run.seed", "7", "run.seed 7 but the run was started with 0"),
    ("orchestrator.max_off_policy_steps", "0", "orchestrator.max_off_policy_steps 0 but the run was started with 1"),
    ("model.path", "/models/other", "model.path '/models/other' but the run was started with None"),
    # a section: its field that changed
    ("trainer.loss.clip_high", "0.5", "trainer.loss.clip_high 0.5 but the run was started with 0.28"),
    ("trainer.lora.rank", "8", "trainer.lora.rank 8 but the run was started with 0"),
])
def test_a_resume_that_changes_what_the_run_means_is_refused_and_changes_nothing(tmp_path, field, value, message):
    run = RunDir(make_run(tmp_path))
    run.write_rollouts(3, [])
    before = contents(run.root)
    changed = load_config([run.config_path], [(field, value)])
    with pytest.raises(FleetrlError, match=rf"^run.dir {run.root}: resume with {re.escape(message)}; a resumed run "
                                           rf"must keep what the run means \(start a new run.dir\)$"):
        run.start(changed, resume=2)
    assert contents(run.root) == before
    again = RunDir(run.root)
    again.start(load_config([run.config_path], []), resume=2)  # the refusal held no lock
    again.close()


def test_a_resume_may_change_what_does_not_define_the_run(tmp_path):
    run = RunDir(make_run(tmp_path))
    changed = load_config([run.config_path], [("run.max_steps", "20"), ("trainer.lr", "1e-5"),
                                              ("inference.workers", "3"), ("orchestrator.reward_timeout_s", "5"),
                                              ("sft.sequences_per_step", "3")])  # an rl run's: no [sft] key defines it
    run.start(changed, resume=2)
    assert load_config([run.config_path], []).run.max_steps == 20
    run.close()


# -- appends survive a kill -----------------------------------------------------------------------

def test_metric_lines_are_synced_to_disk_as_they_are_appended(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(files.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    run = RunDir(tmp_path)
    run.append_metrics(step_line(1))
    assert synced == [str(run.metrics_path)] and run.read_metrics() == [step_line(1)]


def test_a_torn_last_metrics_line_is_dropped_with_a_warning_and_by_the_resume(tmp_path):
    warnings = []
    run = RunDir(make_run(tmp_path), log=warnings.append)
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 4, "distance_m')  # killed mid-append
    assert [m.step for m in run.read_metrics()] == [1, 2, 3]
    assert warnings == [f"fleetrl: {run.metrics_path}: dropped its last line 4, torn by a kill mid-write"]
    run.start(load_config([run.config_path], []), resume=3)
    assert run.metrics_path.read_text().endswith("}\n") and [m.step for m in run.read_metrics()] == [1, 2, 3]
    run.append_metrics(step_line(4))
    assert [m.step for m in run.read_metrics()] == [1, 2, 3, 4]


def test_a_bad_metrics_line_before_the_last_is_an_error_naming_it(tmp_path):
    run = RunDir(make_run(tmp_path))
    lines = run.metrics_path.read_text().splitlines()
    lines[1] = lines[1][:10]
    run.metrics_path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FleetrlError, match=rf"^{run.metrics_path}: line 2 is not JSON .*only the last line may be torn"):
        run.read_metrics()


def test_a_metrics_line_that_is_no_step_line_is_an_error_naming_the_file_record_and_keys(tmp_path):
    run = RunDir(make_run(tmp_path))
    lines = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    del lines[1]["update"]["lr"]
    lines[1]["update"]["kl"] = 0.1  # a figure no StepMetrics has
    run.metrics_path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    with pytest.raises(RecordError, match=rf"^{run.metrics_path}: record 2: not a StepLine: unknown update.kl; "
                                          r"missing update.lr$"):
        run.read_metrics()


def test_an_event_of_no_known_kind_is_an_error_naming_it(tmp_path):
    run = RunDir(tmp_path)
    files.append_line(run.events_path, json.dumps({"t": 1.0, "event": "nap", "step": 1}))
    with pytest.raises(RecordError, match=r"record 1: not an event of the timeline \(event: 'nap'"):
        run.read_events()


async def test_the_runs_final_json_reads_back_as_written_and_a_key_missing_names_the_file(tmp_path):
    fleet = Fleet(FakeProvider("a", "b"), discovery_interval_s=3600, log=lambda *_: None)
    await fleet.start()
    try:
        final = await final_generation(fleet, Tokenizer(), AgreementProbe([1, 2, 3], [-0.5, -1.25]))
    finally:
        await fleet.close()
    assert final.version == 0 and len(final.tokens) == 16 and final.spans == [[0, 0]]
    assert final.workers == {w: FinalWorker(role="aggregated", version=0, checksum=None) for w in ("a", "b")}
    assert final.probe == FinalProbe(token_ids=[1, 2, 3], trainer_logprobs=[-0.5, -1.25])
    run = RunDir(tmp_path)
    run.write_final(final)
    assert run.read_final() == final
    data = json.loads(run.final_path.read_text())
    del data["workers"]["a"]["checksum"]
    run.final_path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=r"final.json: not a FinalRecord: missing workers.a.checksum"):
        run.read_final()


def episode(step):
    """The part of a verifiers episode record the resume reads: its run stamp."""
    return {"env": {"id": "x"}, "run": {"type": "train", "id": "run", "work": {"type": "train", "step": step}}}


def test_a_resume_drops_the_verifiers_episodes_of_the_steps_it_redoes(tmp_path):
    run = RunDir(make_run(tmp_path), log=lambda *_: None)
    for step in (1, 2, 2, 3):
        files.append_line(run.verifiers_episodes_path, json.dumps(episode(step)))
    with open(run.verifiers_episodes_path, "a") as f:
        f.write('{"env": {"id"')  # torn
    run.start(load_config([run.config_path], []), resume=2)
    kept = [json.loads(line) for line in run.verifiers_episodes_path.read_text().splitlines()]
    assert kept == [episode(1), episode(2), episode(2)]
    run.close()


def test_two_writers_of_one_file_each_write_whole(tmp_path, monkeypatch):
    """`fleetrl plot` while the run draws its own plots as it finishes: a second atomic write of
    the same file lands between the first's write and its rename. Both complete (the last
    rename wins), nothing is left beside the file. With one shared temporary name, the second
    writer replaced the first's temporary file and the first's rename found it gone."""
    target = tmp_path / "timeline.png"
    replace = os.replace
    interleaved = []

    def replace_after_another_writer(src, dst):
        if not interleaved:
            interleaved.append(dst)
            atomic_write(target, b"the other writer's")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_another_writer)
    atomic_write(target, b"this writer's")
    assert interleaved and target.read_bytes() == b"this writer's"
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.png"]


def test_events_are_synced_off_the_thread_that_appends_them(tmp_path, monkeypatch):
    """The event loop appends an event per sample: each once waited for its own fsync there."""
    import threading

    run = RunDir(tmp_path / "run")
    run.start(load_config([], []), resume=0)
    synced_on = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced_on.append(threading.current_thread()), fsync(fd))[1])
    for i in range(50):
        run.append_event(SampleEvent(step=1, group=0, sample=i, worker="w0", start=0.0, end=1.0, tokens=1, spans=[[0, 0]]))
    assert [e.sample for e in run.read_events()] == list(range(50))  # in order, all synced
    assert synced_on and threading.current_thread() not in synced_on
    run.close()
    assert len(run.events_path.read_text().splitlines()) == 50


def test_a_batch_an_older_fleetrl_wrote_still_reads_and_an_unknown_key_names_the_file(tmp_path):
    """Batches written before BatchMeta carried seven keys it no longer has: a run resumed or
    verified across the upgrade reads them; a key no fleetrl wrote is an error naming the file."""
    from fleetrl.records import BatchMeta, Figures

    run = RunDir(tmp_path)
    figures = Figures(samples=1, reward_mean=1.0, completion_tokens_mean=3.0)
    meta = BatchMeta(sampled_prompts=1, filtered=0, generated=figures, trained=figures, dropped_by={}, envs={},
                     workers={}, rollout_started=1.0, rollout_finished=2.0, dispatch_version=0, reward_mean=1.0,
                     reward_std=0.0, distance_max=0, distance_mean=0.0)
    run.write_batch(Batch(1, [sample([(0, 0)])], meta=meta))
    data = json.loads(run.batch_path(1).read_text())
    data["meta"].update(waited_from=0.5, max_off_policy_steps=1, tool_failed=0, env_failed=0, misversioned=0,
                        reward_failed=0, empty=0)
    data["dropped"] = 0
    run.batch_path(1).write_text(json.dumps(data))
    assert run.read_batch(1).meta == meta
    data["meta"]["kl"] = 0.1
    run.batch_path(1).write_text(json.dumps(data))
    with pytest.raises(RecordError, match=rf"^{run.batch_path(1)}: meta: not a BatchMeta: unknown kl$"):
        run.read_batch(1)


@pytest.mark.parametrize("part, key, value, said", [
    ("update", "lr", "fast", "update.lr is 'fast', not a valid number"),
    ("batch", "reward_mean", None, "batch.reward_mean is None, not a valid number"),
    ("update", "max_off_policy", 1.5, "update.max_off_policy is 1.5, not a valid integer"),
    ("update", "skipped", 0, "update.skipped is 0, not a valid boolean"),
    ("update", "loss", "nan", "update.loss is 'nan', not a valid number"),
    ("batch", "workers", [], "batch.workers is [], not a valid dictionary"),
])
def test_a_value_of_another_type_is_an_error_naming_the_record_and_the_key(tmp_path, part, key, value, said):
    run = RunDir(make_run(tmp_path))
    lines = [json.loads(line) for line in run.metrics_path.read_text().splitlines()]
    lines[2][part][key] = value
    run.metrics_path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    with pytest.raises(RecordError, match=rf"^{run.metrics_path}: record 3: not a StepLine: {re.escape(said)}$"):
        run.read_metrics()


# A metrics.jsonl line as fleetrl wrote it before December 2026: every figure at the top.
FLAT_LINE = {
    "step": 1, "reward_mean": 0.25, "reward_std": 0.1, "distance_max": 1, "distance_mean": 0.5, "dropped": 0,
    "sampled_prompts": 1, "filtered": 0, "generated_reward_mean": 0.25, "generated_completion_tokens_mean": 12.0,
    "trained_reward_mean": 0.25, "trained_completion_tokens_mean": 12.0, "dropped_by": {},
    "envs": {"reverse": {"groups": 1, "samples": 4, "reward_mean": 0.25, "completion_tokens_mean": 12.0,
                         "trained_samples": 1}},
    "eval": None, "misversioned": 0, "reward_failed": 0, "empty": 0, "skipped": False, "samples": 1,
    "completion_tokens": 12, "tokens": 40, "loss": None, "grad_norm": 1.5, "sampler_kl": 0.01, "mismatch_kl": None,
    "staleness_kl": 0.01, "ratio_mean": 1.0, "clip_frac": 0.0, "truncated_frac": 0.0, "masked_frac": 0.0,
    "entropy": 2.0, "ref_kl": 0.0, "mismatch_tokens": 0, "mismatch_outliers": [], "lr": 2e-5, "tokens_per_s": 100.0,
    "publish_s": 1.5, "checksum": "abc", "worker_versions": {"vllm-0": 1},
    "workers": {"vllm-0": {"version": 1, "completions": 4, "completion_tokens": 48, "tokens_per_s": 12.0,
                           "mismatch_kl": None, "publish_s": 0.5, "publish_bytes": None}},
    "failed_workers": {}, "probe_max_abs_diff": {"vllm-0": 0.0}, "rollout_started": 1e9, "rollout_finished": 1e9 + 5,
    "train_started": 1e9 + 5, "train_finished": 1e9 + 9}


def test_a_run_an_older_fleetrl_wrote_in_the_flat_form_still_verifies_resumes_and_plots(tmp_path):
    """Its lines are read by the one reader of the flat form (records.FlatStepLine); a resume
    keeps them, and appends lines of today's form after them, and both are plotted."""
    run = make_run(tmp_path, steps=3)
    lines = [{**FLAT_LINE, "step": step, "distance_max": 0 if step == 1 else 1,
              "worker_versions": {"vllm-0": step, "vllm-1": step}} for step in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    RunDir(run).write_manifest()
    assert "3 steps, 3 trained samples, max off-policy distance 1 <= k = 1" in verify_run(run)
    resumed = RunDir(run, log=lambda *_: None)
    resumed.start(load_config([resumed.config_path], []), resume=2)
    resumed.append_metrics(step_line(3))
    assert [type(line).__name__ for line in resumed.read_metrics()] == ["FlatStepLine", "FlatStepLine", "StepLine"]
    assert all(path.stat().st_size > 0 for path in resumed.write_plots())
    resumed.close()


def test_a_run_whose_config_an_older_fleetrl_wrote_with_the_loss_options_in_trainer_verifies_and_resumes(tmp_path):
    """Before [trainer.loss] (issue 38) the loss options were [trainer] keys: such a config.toml
    still verifies, and a resume reads them where they are now and keeps them."""
    run = RunDir(make_run(tmp_path), log=lambda *_: None)
    old_form = tomllib.loads(to_toml(load_config([run.config_path], [("trainer.loss.clip_high", "0.5")])))
    old_form["trainer"].update(old_form["trainer"].pop("loss"))
    run.config_path.write_text(tomli_w.dumps(old_form))
    run.write_manifest()
    assert "3 steps, 3 trained samples" in verify_run(run.root)
    assert run.read_config().trainer.loss.clip_high == 0.5
    with pytest.raises(FleetrlError, match=r"resume with trainer.loss.clip_high 0.28 but the run was started with 0.5"):
        run.start(load_config([], [("trainer.loss.clip_high", "0.28")], saved=[run.config_path]), resume=2)
    run.start(run.read_config(), resume=2)
    assert "clip_high" not in tomllib.loads(run.config_path.read_text())["trainer"]  # written in today's form
    assert run.read_config().trainer.loss.clip_high == 0.5
    run.close()
