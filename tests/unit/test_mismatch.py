"""mismatch_kl and staleness_kl: each token scored under the version that sampled it, on a tiny
real model (trainer/mismatch.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fleetrl.batch import Batch
from fleetrl.trainer.kept_weights import KeptWeights
from fleetrl.trainer.loss import k3
from fleetrl.trainer.mismatch import OUTLIER_KL, mismatch_sums, outliers
from fleetrl.trainer.model import load_policy, named_tensors
from fleetrl.trainer.step import build_optimizer, train_step
from fleetrl.versions import VersionSpan

from tests.unit.test_trainer_step import CPU, FAST, make_batch, model_dir, reference_logprobs  # noqa: F401


def sampled_at(model, batch: Batch, version: int, step: int) -> Batch:
    """`batch` as workers at `version` (serving `model`'s weights exactly) sampled it for `step`."""
    for sample in batch.samples:
        sample.spans = [VersionSpan(version, 0)]
        sample.inference_logprobs = reference_logprobs(model, sample)
    batch.step = step
    return batch


def test_tokens_one_version_behind_are_scored_under_their_own_version(model_dir):
    """Step 2's tokens were sampled at v0 by exact workers: against the trainer at v1 they
    differ (the policy moved: staleness, and the ratio's sampler_kl), against the trainer at v0
    they agree to float rounding (mismatch)."""
    model = load_policy(model_dir, CPU)
    v0 = load_policy(model_dir, CPU)
    optimizer, previous = build_optimizer(model, FAST), KeptWeights()
    train_step(model, optimizer, make_batch(model, seed=1), FAST, previous)  # v1; `previous` keeps v0
    assert previous.version == 0
    metrics = train_step(model, optimizer, sampled_at(v0, make_batch(v0, seed=2), version=0, step=2), FAST, previous)
    assert metrics.mismatch_tokens == metrics.completion_tokens
    assert metrics.mismatch_kl == pytest.approx(0.0, abs=1e-9)
    assert metrics.staleness_kl > 1e-4
    assert metrics.sampler_kl == pytest.approx(metrics.staleness_kl, rel=1e-3)


def test_the_weights_swapped_in_for_scoring_go_back_untouched(model_dir):
    model = load_policy(model_dir, CPU)
    previous = KeptWeights()
    previous.remember(load_policy(model_dir, CPU), version=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    before = {name: t.clone() for name, t in named_tensors(model)}
    with previous.swapped_in(model):
        assert all(not torch.equal(t, before[n]) for n, t in named_tensors(model))
    assert all(torch.equal(t, before[n]) for n, t in named_tensors(model))


def test_without_the_previous_version_only_the_current_versions_tokens_are_measured(model_dir):
    """The first step after a resume: the checkpoint holds no previous version."""
    model = load_policy(model_dir, CPU)
    batch = make_batch(model, samples=4, step=2)  # v1's tokens (lag 0), exact
    batch.samples[0].spans = [VersionSpan(0, 0)]  # one sample at v0: not measurable here
    metrics = train_step(model, build_optimizer(model, FAST), batch, FAST, KeptWeights())
    assert metrics.mismatch_tokens == metrics.completion_tokens - len(batch.samples[0].completion_ids)
    assert metrics.mismatch_kl == pytest.approx(0.0, abs=1e-9) and metrics.staleness_kl == 0.0
    only_behind = make_batch(model, samples=2, step=2)
    for s in only_behind.samples:
        s.spans = [VersionSpan(0, 0)]
    metrics = train_step(model, build_optimizer(model, FAST), only_behind, FAST)
    assert metrics.mismatch_tokens == 0 and metrics.mismatch_kl is None


def test_a_sample_split_across_a_publish_is_measured_on_both_sides(model_dir):
    """Keep mode: a sample's first tokens at v0, the rest at v1; with v0's and v1's logprobs where
    each sampled, the mismatch is 0 on both sides, and only v0's tokens are stale."""
    model = load_policy(model_dir, CPU)
    v0 = load_policy(model_dir, CPU)
    optimizer, previous = build_optimizer(model, FAST), KeptWeights()
    train_step(model, optimizer, make_batch(model, seed=1), FAST, previous)
    batch = make_batch(v0, seed=3, samples=2, step=2)
    sample = batch.samples[0]
    sample.completion_ids = [5, 9, 17, 33, 2, 8]
    sample.spans = [VersionSpan(0, 0), VersionSpan(1, 3)]
    at_v0, at_v1 = reference_logprobs(v0, sample), reference_logprobs(model, sample)
    sample.inference_logprobs = at_v0[:3] + at_v1[3:]
    batch.samples[1].spans = [VersionSpan(1, 0)]
    batch.samples[1].inference_logprobs = reference_logprobs(model, batch.samples[1])
    metrics = train_step(model, optimizer, batch, FAST, previous)
    assert metrics.mismatch_tokens == metrics.completion_tokens
    assert metrics.mismatch_kl == pytest.approx(0.0, abs=1e-9)
    stale = sum(k3(torch.tensor(now - then)).item() for now, then in zip(at_v1[:3], at_v0[:3]))
    assert metrics.staleness_kl * metrics.mismatch_tokens == pytest.approx(stale, rel=1e-4)


def test_each_workers_mismatch_is_its_own_and_the_odd_one_is_named(model_dir):
    model = load_policy(model_dir, CPU)
    batch = make_batch(model, samples=6)
    rng = random.Random(0)
    for i, sample in enumerate(batch.samples):
        sample.worker = f"w{i % 3}"
        if sample.worker == "w2":  # serves other weights than the trainer's
            sample.inference_logprobs = [lp + rng.gauss(0, 0.5) for lp in sample.inference_logprobs]
    metrics = train_step(model, build_optimizer(model, FAST), batch, FAST)
    assert sorted(metrics.worker_mismatch_kl) == ["w0", "w1", "w2"]
    assert metrics.worker_mismatch_kl["w0"] < 1e-9 and metrics.worker_mismatch_kl["w1"] < 1e-9
    assert metrics.worker_mismatch_kl["w2"] > OUTLIER_KL
    assert outliers(metrics.worker_mismatch_kl) == metrics.mismatch_outliers == ["w2"]
    tokens = {w: sum(len(s.completion_ids) for s in batch.samples if s.worker == w) for w in ("w0", "w1", "w2")}
    assert metrics.mismatch_kl == pytest.approx(
        sum(metrics.worker_mismatch_kl[w] * tokens[w] for w in tokens) / sum(tokens.values()))


def test_k3_by_hand_and_what_is_not_measured_carries_nothing():
    lp_now = torch.tensor([[-1.0, -2.0, -3.0]])
    lp_prev = torch.tensor([[-1.5, -2.0, float("nan")]])
    inference = torch.tensor([[-1.2, -2.5, -3.0]])
    lag = torch.tensor([[0, 1, 2]])  # the third is two versions behind: not measured
    sums = mismatch_sums(lp_now, lp_prev, inference, lag, torch.ones(1, 3), torch.tensor([0]), 1)
    by_hand = lambda log_r: math.exp(log_r) - 1 - log_r  # noqa: E731
    assert sums.tokens.item() == 2
    assert sums.mismatch_kl.item() == pytest.approx(by_hand(-1.0 + 1.2) + by_hand(-2.0 + 2.5))
    assert sums.staleness_kl.item() == pytest.approx(0.0 + by_hand(-2.0 + 2.0))
    assert sums.worker_mismatch_kl.tolist() == pytest.approx([sums.mismatch_kl.item()])


def test_outliers_need_other_workers_and_a_clear_margin():
    assert outliers({"a": 0.5}) == []
    assert outliers({"a": 1e-9, "b": 2e-9, "c": 5e-4}) == []  # below OUTLIER_KL
    assert outliers({"a": 0.01, "b": 0.02, "c": 0.05}) == []  # not 10x the others
    assert outliers({"a": 1e-9, "b": 0.3}) == ["b"]

