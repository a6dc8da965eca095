"""Two real trainer ranks (FSDP2 over gloo, spawned processes) against one rank in this process:
the same batch must give the same update, the same published tensors, and a checkpoint that
round-trips across ranks and across world sizes; and a checkpoint that 4 ranks under a real
torchrun wrote resumes on 2 ranks (torchrun again) and on 1."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fleetrl.cli import main
from fleetrl.trainer import checkpoint, distributed
from fleetrl.trainer.kept_weights import KeptWeights
from fleetrl.trainer.model import is_sharded, load_policy, named_tensors
from fleetrl.trainer.step import build_optimizer, train_step
from fleetrl.versions import VersionSpan
from tests.ranks import spawn_ranks
from tests.unit.test_trainer_step import FAST, make_batch, save_tiny_model, save_tiny_tokenizer

WORLD = 2
CPU = torch.device("cpu")
# One sample per micro-batch: rank 0 gets 3 of the 5 samples, rank 1 gets 2 and must run a
# zero-weight micro-batch to stay in step; the second batch has 1 sample, so rank 1 trains on
# nothing at all, and its sample was sampled at v0: scored under v0 (trainer/mismatch.py), which
# every rank takes part in, rank 1 with nothing to score.
CFG = replace(FAST, micro_batch_tokens=1)


def full_weights(model) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.clone()) for name, tensor in named_tensors(model)]


def _rank_main(rank: int, model_dir, batches, out_dir) -> None:
    world = distributed.init(timeout_s=120)  # joined already (tests/ranks.py): the World of it
    model = load_policy(model_dir, world.device)
    assert is_sharded(model)
    optimizer, previous = build_optimizer(model, CFG), KeptWeights()
    initial = full_weights(model)
    first = train_step(model, optimizer, batches[0], CFG, previous)
    updated = full_weights(model)

    ckpt = out_dir / "checkpoints"
    checkpoint.save(ckpt, 1, model, optimizer, keep=2)
    restored = load_policy(model_dir, world.device)
    restored_optimizer = build_optimizer(restored, CFG)
    loaded_step = checkpoint.load(ckpt, restored, restored_optimizer)
    restored_weights = full_weights(restored)
    second = train_step(model, optimizer, batches[1], CFG, previous)
    train_step(restored, restored_optimizer, batches[1], CFG)
    continued, continued_restored = full_weights(model), full_weights(restored)
    if rank == 0:
        torch.save({"initial": initial, "first": first.to_dict(), "updated": updated,
                    "loaded_step": loaded_step, "restored": restored_weights,
                    "second": second.to_dict(), "continued": continued,
                    "continued_restored": continued_restored}, out_dir / "rank0.pt")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(model_dir)
    save_tiny_tokenizer(model_dir)  # what export copies
    model = load_policy(model_dir, CPU)
    batches = [make_batch(model, seed=0, samples=5, noise=0.3), make_batch(model, seed=1, samples=1, step=2)]
    batches[1].samples[0].spans = [VersionSpan(0, 0)]  # the base model's logprobs: sampled at v0, exactly
    return model_dir, batches


@pytest.fixture(scope="module")
def two_ranks(setup, tmp_path_factory):
    model_dir, batches = setup
    out_dir = tmp_path_factory.mktemp("two-ranks")
    spawn_ranks(_rank_main, WORLD, out_dir, model_dir, batches, out_dir)
    return torch.load(out_dir / "rank0.pt"), out_dir


@pytest.fixture(scope="module")
def one_rank(setup, tmp_path_factory):
    model_dir, batches = setup
    model = load_policy(model_dir, CPU)
    optimizer, previous = build_optimizer(model, CFG), KeptWeights()
    initial = full_weights(model)
    first = train_step(model, optimizer, batches[0], CFG, previous)
    updated = full_weights(model)
    checkpoints = tmp_path_factory.mktemp("one-rank") / "checkpoints"
    checkpoint.save(checkpoints, 1, model, optimizer, keep=2)
    second = train_step(model, optimizer, batches[1], CFG, previous)
    return {"initial": initial, "first": first.to_dict(), "updated": updated, "second": second.to_dict(),
            "continued": full_weights(model), "checkpoints": checkpoints}


def assert_same_weights(got, expected, exact: bool = False) -> None:
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, a), (_, b) in zip(got, expected, strict=True):
        if exact:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_named_tensors_on_two_ranks_equal_one_rank(two_ranks, one_rank):
    got = two_ranks[0]["initial"]
    assert_same_weights(got, one_rank["initial"], exact=True)
    names = [n for n, _ in got]
    assert len(names) == len(set(names)) and "lm_head.weight" not in names  # tied: sent once


def test_two_rank_step_equals_one_rank_step(two_ranks, one_rank):
    result = two_ranks[0]
    for key in ("loss", "grad_norm", "lr", "sampler_kl", "mismatch_kl", "ratio_mean", "clip_frac"):
        assert result["first"][key] == pytest.approx(one_rank["first"][key], rel=1e-5, abs=1e-9), key
    assert result["first"]["completion_tokens"] == one_rank["first"]["completion_tokens"]
    assert_same_weights(result["updated"], one_rank["updated"])
    # A batch smaller than the world: rank 1 has no sample and still keeps in step, through the
    # scoring under v0 too, whose weights the sharded model swapped in and out again.
    second, alone = result["second"], one_rank["second"]
    assert second["samples"] == 1
    assert second["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    assert second["mismatch_tokens"] == alone["mismatch_tokens"] == second["completion_tokens"]
    assert second["mismatch_kl"] == pytest.approx(0.0, abs=1e-9) and alone["mismatch_kl"] == pytest.approx(0.0, abs=1e-9)
    assert second["staleness_kl"] == pytest.approx(alone["staleness_kl"], rel=1e-4) and second["staleness_kl"] > 0
    assert_same_weights(result["continued"], one_rank["continued"])


def test_two_rank_checkpoint_round_trip(two_ranks):
    result, _ = two_ranks
    assert result["loaded_step"] == 1
    assert_same_weights(result["restored"], result["updated"], exact=True)
    # The optimizer state came back too: training on from the restored copy is identical.
    assert_same_weights(result["continued_restored"], result["continued"], exact=True)


def test_a_two_rank_checkpoint_loads_into_one_rank(setup, two_ranks):
    model_dir, _ = setup
    result, out_dir = two_ranks
    model = load_policy(model_dir, CPU)
    assert checkpoint.load(out_dir / "checkpoints", model, build_optimizer(model, CFG)) == 1
    assert_same_weights(full_weights(model), result["updated"], exact=True)


def test_a_two_rank_checkpoint_exports_as_one_ranks_does(setup, two_ranks, one_rank, tmp_path):
    """`fleetrl export --step 1` of the run as written by 2 ranks and by 1: the same Hugging Face folder
    (the weights as close as the two updates are; every other file byte for byte)."""
    from safetensors.torch import load_file

    model_dir, _ = setup
    _, out_dir = two_ranks
    for name, run_dir in (("two", out_dir), ("one", one_rank["checkpoints"].parent)):
        # Each checkpoint folder becomes a run directory as `fleetrl rl` leaves one: its config names the model.
        (run_dir / "config.toml").write_text(f'[model]\npath = "{model_dir}"\n')
        assert main(["export", str(run_dir), str(tmp_path / name), "--step", "1"]) == 0
    two, one = (load_file(tmp_path / name / "model.safetensors") for name in ("two", "one"))
    assert_same_weights(sorted(two.items()), sorted(one.items()))
    assert_same_weights([(n, two[n]) for n, _ in two_ranks[0]["updated"]], two_ranks[0]["updated"], exact=True)
    files = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir()) and "tokenizer.json" in files
    for name in files:
        if name != "model.safetensors":
            assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


def torchrun(ranks: int, *args: str) -> None:
    """`torchrun --standalone --nproc-per-node RANKS -m tests.integration.reshard_job ARGS`."""
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(ranks),
               "-m", "tests.integration.reshard_job", *args]
    done = subprocess.run(command, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_four_rank_checkpoint_resumes_on_two_ranks_and_on_one(setup, tmp_path):
    """DCP resharding: the step-1 checkpoint of 4 ranks loads on 2 and on 1 with the very weights
    the 4 held, and the optimizer state with them: the next step matches the 4 ranks' own."""
    model_dir, batches = setup
    torch.save(batches, tmp_path / "batches.pt")
    torchrun(4, "write", str(tmp_path), str(model_dir))
    four = torch.load(tmp_path / "write-4.pt")
    assert {p.name for p in (tmp_path / "checkpoints" / "step_000001").glob("*.distcp")} == {
        f"__{r}_0.distcp" for r in range(4)}  # a shard from each of the 4 ranks
    torchrun(2, "resume", str(tmp_path), str(model_dir))
    two = torch.load(tmp_path / "resume-2.pt")
    assert two["loaded_step"] == 1
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, CFG)
    assert checkpoint.load(tmp_path / "checkpoints", model, optimizer) == 1
    one = {"updated": full_weights(model)}
    train_step(model, optimizer, batches[1], CFG)
    one["continued"] = full_weights(model)
    for resumed in (two, one):
        assert_same_weights(resumed["updated"], four["updated"], exact=True)
        assert_same_weights(resumed["continued"], four["continued"])
