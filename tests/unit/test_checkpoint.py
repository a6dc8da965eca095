"""Trainer checkpoints on a tiny random Llama (fp32, CPU, one rank): round trip, atomicity,
integrity (checksums, finite weights) and pruning."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from fleetrl.errors import FleetrlError
from fleetrl.trainer import checkpoint
from fleetrl.trainer.model import load_policy
from fleetrl.trainer.step import build_optimizer, train_step
from tests.unit.test_trainer_step import CPU, FAST, make_batch, model_dir, weights  # noqa: F401 (a fixture)


def optimizer_state(optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values()]


def test_checkpoint_round_trip_restores_model_optimizer_and_step(model_dir, tmp_path):
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, FAST)
    batch = make_batch(model, noise=0.2)
    for _ in range(2):
        train_step(model, optimizer, batch, FAST)
    checkpoint.save(tmp_path, 2, model, optimizer, keep=2)

    restored = load_policy(model_dir, CPU)
    restored_optimizer = build_optimizer(restored, FAST)
    assert checkpoint.load(tmp_path, restored, restored_optimizer) == 2
    for name, tensor in weights(model).items():
        assert torch.equal(weights(restored)[name], tensor), name
    assert len(optimizer_state(restored_optimizer)) == len(optimizer_state(optimizer)) > 0
    for a, b in zip(optimizer_state(restored_optimizer), optimizer_state(optimizer), strict=True):
        assert torch.equal(a, b)
    # Training on from either is the same training.
    train_step(model, optimizer, batch, FAST)
    train_step(restored, restored_optimizer, batch, FAST)
    for name, tensor in weights(model).items():
        assert torch.equal(weights(restored)[name], tensor), name


def test_latest_ignores_half_written_checkpoints_and_old_ones_are_pruned(model_dir, tmp_path):
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, FAST)
    assert checkpoint.latest(tmp_path) is None
    assert checkpoint.load(tmp_path, model, optimizer) is None
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model, optimizer, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]

    # A crash inside the save (DCP wrote part of its files) leaves only the temp folder.
    (tmp_path / ".tmp-step_000004").mkdir()
    (tmp_path / ".tmp-step_000004" / "__0_0.distcp").write_bytes(b"half")
    # A folder with the final name but no completion record (copied by hand, torn by a
    # filesystem), and one whose record names another step.
    (tmp_path / "step_000005").mkdir()
    (tmp_path / "step_000005" / ".metadata").write_bytes(b"")
    (tmp_path / "step_000006").mkdir()
    (tmp_path / "step_000006" / "complete.json").write_text('{"step": 2}')
    (tmp_path / "step_000007").mkdir()
    (tmp_path / "step_000007" / "complete.json").write_text('{"st')
    # The record of a fleetrl before December 2026: no checksums to verify its files with.
    (tmp_path / "step_000008").mkdir()
    (tmp_path / "step_000008" / "complete.json").write_text('{"step": 8, "world_size": 1}')
    lines = []
    assert checkpoint.latest(tmp_path, log=lines.append) == (3, tmp_path / "step_000003")
    assert [line.split()[2] for line in lines] == [str(tmp_path / f"step_00000{n}") for n in (8, 7, 6, 5)]
    assert lines[0].endswith("skipped: complete.json lacks the checksums or the finite-weights mark that fleetrl writes")
    assert checkpoint.load(tmp_path, model, optimizer, log=lines.append) == 3

    checkpoint.save(tmp_path, 4, model, optimizer, keep=2)  # also clears the crashed temp folder
    assert not (tmp_path / ".tmp-step_000004").exists()
    assert checkpoint.latest(tmp_path) == (4, tmp_path / "step_000004")
    checkpoint.save(tmp_path, 4, model, optimizer, keep=2)  # saved again: replaced in place
    assert checkpoint.latest(tmp_path) == (4, tmp_path / "step_000004")
    assert not list(tmp_path.glob(".*"))


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(model_dir, tmp_path, monkeypatch):
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, FAST)
    checkpoint.save(tmp_path, 1, model, optimizer, keep=3)

    def crash(state, checkpoint_id):
        (checkpoint_id / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.dcp, "save", crash)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, 2, model, optimizer, keep=3)
    assert checkpoint.latest(tmp_path) == (1, tmp_path / "step_000001")


def trained(model_dir, steps: int = 1):
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, FAST)
    batch = make_batch(model, noise=0.2)
    for _ in range(steps):
        train_step(model, optimizer, batch, FAST)
    return model, optimizer


def test_the_record_lists_every_file_with_its_size_and_sha256(model_dir, tmp_path):
    model, optimizer = trained(model_dir)
    folder = checkpoint.save(tmp_path, 1, model, optimizer, keep=2)
    record = json.loads((folder / "complete.json").read_text())
    assert record["step"] == 1 and record["finite"] is True
    on_disk = {p.name: p for p in folder.iterdir() if p.name != "complete.json"}
    assert ".metadata" in on_disk and any(name.endswith(".distcp") for name in on_disk)
    assert record["files"] == {name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                               for name, p in on_disk.items()}


def shard(folder):
    return next(folder.glob("*.distcp"))


def truncate(folder):
    path = shard(folder)
    path.write_bytes(path.read_bytes()[:-100])
    return path.name


def flip_a_byte(folder):
    path = shard(folder)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path.name


def delete_metadata(folder):
    (folder / ".metadata").unlink()
    return ".metadata"


@pytest.mark.parametrize("damage", [truncate, flip_a_byte, delete_metadata])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one_naming_the_file(model_dir, tmp_path, damage):
    model, optimizer = trained(model_dir)
    checkpoint.save(tmp_path, 1, model, optimizer, keep=3)
    at_step_1 = weights(model)
    train_step(model, optimizer, make_batch(model, seed=1), FAST)
    newest = checkpoint.save(tmp_path, 2, model, optimizer, keep=3)
    damaged = damage(newest)

    lines = []
    assert checkpoint.latest(tmp_path, log=lines.append) == (1, tmp_path / "step_000001")
    assert len(lines) == 1 and str(newest) in lines[0] and damaged in lines[0], lines

    restored = load_policy(model_dir, CPU)
    assert checkpoint.load(tmp_path, restored, build_optimizer(restored, FAST), log=lines.append) == 1
    for name, tensor in at_step_1.items():
        assert torch.equal(weights(restored)[name], tensor), name


def test_a_resume_reads_the_checkpoint_once_while_its_files_stay_as_they_were(model_dir, tmp_path, monkeypatch):
    model, optimizer = trained(model_dir)
    folder = checkpoint.save(tmp_path, 1, model, optimizer, keep=2)
    hashed = []
    real_sha256 = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: hashed.append(path.name) or real_sha256(path))
    monkeypatch.setattr(checkpoint, "_verified", {})  # as in a new process

    assert checkpoint.latest(tmp_path) == (1, folder)  # what `fleetrl rl` picks the resume step with
    files = sorted(hashed)
    assert checkpoint.load(tmp_path, model, optimizer) == 1  # then the loop loads it
    assert sorted(hashed) == files == sorted(p.name for p in folder.iterdir() if p.name != "complete.json")

    flip_a_byte(folder)  # a write since: verified again, and refused
    lines = []
    assert checkpoint.latest(tmp_path, log=lines.append) is None
    assert "does not match its sha256" in lines[0]


def test_pruning_never_deletes_the_newest_good_checkpoint(model_dir, tmp_path):
    model, optimizer = trained(model_dir)
    checkpoint.save(tmp_path, 1, model, optimizer, keep=2)
    truncate(checkpoint.save(tmp_path, 9, model, optimizer, keep=2))
    assert checkpoint.latest(tmp_path, log=lambda line: None)[0] == 1  # a resume goes back to step 1
    # ... and saves step 2 with keep = 1: step 9 (damaged) still numbers past it, but the one
    # good checkpoint stays.
    checkpoint.save(tmp_path, 2, model, optimizer, keep=1)
    assert checkpoint.latest(tmp_path, log=lambda line: None) == (2, tmp_path / "step_000002")


def test_weights_that_are_not_finite_are_never_checkpointed(model_dir, tmp_path):
    model, optimizer = trained(model_dir)
    checkpoint.save(tmp_path, 1, model, optimizer, keep=2)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[3, 1] = math.nan
    with pytest.raises(FleetrlError, match=r"^step 2: parameter model\.layers\.0\.self_attn\.q_proj\.weight "
                                           r"is not finite; checkpoint not saved$"):
        checkpoint.save(tmp_path, 2, model, optimizer, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert checkpoint.latest(tmp_path) == (1, tmp_path / "step_000001")
