"""The GPU weight path, run on the CPU: the training loop's publish without a snapshot
(`loop.publish_streamed`) over two real gloo ranks, rank 0 pulling full tensors gathered from
the FSDP2 shards one at a time (trainer/gather.py) and packing them into buckets as they come
(weights/buckets.packed_buckets); and on one rank through the whole loop. On CUDA this path has
not been run (docs/benchmarks.md)."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor

from fleetrl.errors import FleetrlError
from fleetrl.trainer import distributed, loop
from fleetrl.trainer.gather import WeightGather
from fleetrl.trainer.loop import Hooks
from fleetrl.trainer.model import agreement_probe, is_sharded, load_policy, named_tensors
from fleetrl.weights.buckets import packed_buckets, unpack_bucket
from tests.ranks import spawn_ranks
from tests.unit.test_trainer_step import CPU, Run, save_tiny_model, train_step_then_break_a_weight

# The tiny model's tensors are 128 B to 16 KiB: the 16 KiB embedding is over the limit (alone in
# its bucket), the layers' 2-8 KiB projections share buckets.
BUCKET_BYTES = 10_000


class FullTensorBytes:
    """Counts the bytes of full tensors still alive (weakrefs), and the most at any one time."""

    def __init__(self) -> None:
        self.alive: dict[int, int] = {}
        self.peak_bytes = 0
        self.peak_count = 0
        self._next = 0

    def track(self, pair: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        key, self._next = self._next, self._next + 1
        self.alive[key] = pair[1].nbytes
        weakref.finalize(pair[1], self.alive.pop, key)
        self.peak_bytes = max(self.peak_bytes, sum(self.alive.values()))
        self.peak_count = max(self.peak_count, len(self.alive))
        return pair


def _lead(gather: WeightGather, result: dict) -> None:
    """Rank 0's publish, on a thread of its own as on the fleet's control thread."""
    # Sharded again after the probe's forward: every parameter is gathered from the shards.
    result["sharded"] = all(isinstance(param, DTensor) for _, param in gather.params)
    # A transfer that fails after two tensors drops its stream; the fleet's retry starts over.
    abandoned = gather.tensors()
    next(abandoned)
    next(abandoned)
    del abandoned
    counter = FullTensorBytes()
    received, buckets = [], []
    for buffer, metas in packed_buckets(map(counter.track, gather.tensors()), BUCKET_BYTES, CPU):
        buckets.append((buffer.numel(), [m.name for m in metas]))
        received += [(name, tensor.clone()) for name, tensor in unpack_bucket(buffer, metas)]
        del buffer
    result.update(received=received, buckets=buckets, peak_bytes=counter.peak_bytes, peak_count=counter.peak_count)


def _publish(result: dict):
    def publish(version, gather, probe_ids, reference):
        result["gather"] = gather
        leader = threading.Thread(target=_lead, args=(gather, result))
        leader.start()
        leader.join()
        return "published"

    return publish


def _rank_main(rank: int, model_dir, out_dir) -> None:
    world = distributed.init(timeout_s=60)  # joined already (tests/ranks.py): the World of it
    model = load_policy(model_dir, world.device)
    assert is_sharded(model)
    expected = [(name, tensor.clone()) for name, tensor in named_tensors(model)]
    result: dict = {}
    hooks = Hooks(wait_batch=lambda step: None, publish=_publish(result) if rank == 0 else None)
    returned = loop.publish_streamed(1, model, world, agreement_probe(model), hooks)
    # The session left no collective half done: the ranks are in step for the next one.
    after = [(name, tensor.clone()) for name, tensor in named_tensors(model)]
    if rank == 0:
        try:
            next(result.pop("gather").tensors())
        except RuntimeError as e:
            result["after_close"] = str(e)
        torch.save({"expected": expected, "after": after, "returned": returned, **result}, out_dir / "rank0.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(model_dir)
    out_dir = tmp_path_factory.mktemp("gather")
    spawn_ranks(_rank_main, 2, out_dir, model_dir, out_dir, timeout_s=120)
    return torch.load(out_dir / "rank0.pt")


def test_the_gather_yields_exactly_the_named_tensors_in_order(two_ranks):
    assert two_ranks["returned"] == "published" and two_ranks["sharded"]
    expected, received = two_ranks["expected"], two_ranks["received"]
    assert [name for name, _ in received] == [name for name, _ in expected]
    for (name, want), (_, got) in zip(expected, received):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert [name for name, _ in two_ranks["after"]] == [name for name, _ in expected]


def test_buckets_keep_to_the_limit_and_an_oversize_tensor_travels_alone(two_ranks):
    buckets = two_ranks["buckets"]
    assert len(buckets) > 2
    assert all(size <= BUCKET_BYTES or len(names) == 1 for size, names in buckets)
    sizes = {name: tensor.nbytes for name, tensor in two_ranks["expected"]}
    oversize = [name for name, nbytes in sizes.items() if nbytes > BUCKET_BYTES]
    assert oversize and all([name] in [names for _, names in buckets] for name in oversize)
    assert any(len(names) > 1 for _, names in buckets)


def test_full_tensors_are_gathered_one_at_a_time_within_one_bucket(two_ranks):
    largest = max(tensor.nbytes for _, tensor in two_ranks["expected"])
    assert two_ranks["peak_count"] == 1
    assert two_ranks["peak_bytes"] == largest <= max(BUCKET_BYTES, largest)


def test_a_closed_gather_refuses_to_stream(two_ranks):
    assert "closed" in two_ranks["after_close"]


# -- the training loop's publish without a snapshot (one rank) ------------------------------


class StreamedRun(Run):
    """`loop.train` on one CPU rank, publishing as on CUDA (a WeightGather, no snapshot)."""

    def publish(self, version, weights, probe_ids, reference):
        assert isinstance(weights, WeightGather)
        self.gather = weights
        return super().publish(version, {name: t.clone() for name, t in weights.tensors()}, probe_ids, reference)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-1")
    save_tiny_model(path)
    return path


def test_a_streamed_publish_sends_the_stepped_weights_and_keeps_nothing(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "streams_weights", lambda world: True)
    run = StreamedRun(model_dir, tmp_path)
    run.train()
    assert sorted(run.published) == [1, 2, 3]
    assert not torch.equal(run.published[1]["model.norm.weight"], run.published[3]["model.norm.weight"])
    with pytest.raises(RuntimeError, match="closed"):
        next(run.gather.tensors())  # valid only while the publish ran


def test_a_streamed_publish_refuses_weights_that_are_not_finite(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "streams_weights", lambda world: True)
    monkeypatch.setattr(loop, "train_step", train_step_then_break_a_weight)
    run = StreamedRun(model_dir, tmp_path)
    with pytest.raises(FleetrlError, match=r"^step 1: weight model\.layers\.1\.mlp\.down_proj\.weight is not "
                                           r"finite; version 1 not published"):
        run.train()
    assert not run.published
