"""The trainer step and checkpoints on a tiny random Llama (fp32, CPU, one rank)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from fleetrl.batch import Batch, Sample
from fleetrl.versions import VersionSpan
from fleetrl.trainer import checkpoint
from fleetrl.trainer.model import load_policy, named_tensors
from fleetrl.trainer.step import StepConfig, build_optimizer, micro_batches, rank_samples, train_step

VOCAB = 128
CPU = torch.device("cpu")
FAST = StepConfig(lr=1e-3, max_grad_norm=1.0, micro_batch_tokens=64)


def save_tiny_model(path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)  # tied, like SmolLM2
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def reference_logprobs(model, sample: Sample) -> list[float]:
    """log pi of each completion token from a plain, unpadded forward of one sample."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    p = len(sample.prompt_ids)
    return [logprobs[p - 1 + i, tok].item() for i, tok in enumerate(sample.completion_ids)]


def make_batch(model, seed: int = 0, samples: int = 6, step: int = 1, noise: float = 0.0) -> Batch:
    """Groups of 2 samples of one prompt, ragged lengths, advantages of +-1 within each group,
    inference logprobs = the model's own (plus `noise`, to stand in for a sampler mismatch)."""
    rng = random.Random(seed)
    out = []
    for i in range(samples):
        group = i // 2
        prompt = [1 + (group * 7 + j) % (VOCAB - 1) for j in range(3 + group % 4)]
        completion = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        sample = Sample(prompt, completion, [0.0] * len(completion), [VersionSpan(step - 1, 0)],
                        reward=float(i % 2), advantage=1.0 if i % 2 else -1.0, group=group)
        sample.inference_logprobs = [lp + rng.gauss(0, noise) for lp in reference_logprobs(model, sample)]
        out.append(sample)
    return Batch(step=step, samples=out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(path)
    return path


def weights(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in named_tensors(model)}


# -- the step ----------------------------------------------------------------------------------


def test_padded_logprobs_agree_with_a_plain_forward(model_dir):
    model = load_policy(model_dir, CPU)
    batch = make_batch(model)
    metrics = train_step(model, build_optimizer(model, FAST), batch, FAST)
    # The sampler's logprobs equal the trainer's: padding and column alignment are right.
    assert metrics.mismatch_kl == pytest.approx(0.0, abs=1e-9)
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert metrics.clip_frac == 0 and metrics.truncated_frac == 0
    assert metrics.samples == 6
    assert metrics.completion_tokens == sum(len(s.completion_ids) for s in batch.samples)
    assert metrics.tokens == metrics.completion_tokens + sum(len(s.prompt_ids) for s in batch.samples)
    assert metrics.max_off_policy == 0
    assert metrics.step == 1 and metrics.grad_norm > 0 and metrics.tokens_per_s > 0


def test_mismatch_shows_in_the_metrics(model_dir):
    model = load_policy(model_dir, CPU)
    batch = make_batch(model, noise=0.5)
    metrics = train_step(model, build_optimizer(model, FAST), batch, FAST)
    assert metrics.mismatch_kl > 0.01
    assert metrics.clip_frac > 0


def test_a_step_changes_the_weights_and_repeating_it_lowers_the_loss(model_dir):
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, FAST)
    batch = make_batch(model)
    before = weights(model)
    losses = [train_step(model, optimizer, batch, FAST).loss for _ in range(4)]
    after = weights(model)
    assert before.keys() == after.keys()
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05, losses


def test_micro_batching_does_not_change_the_update(model_dir):
    updated = []
    for budget in (10_000, 1):  # one micro-batch, then one sample per micro-batch
        model = load_policy(model_dir, CPU)
        batch = make_batch(model, noise=0.3)
        cfg = replace(FAST, micro_batch_tokens=budget)
        metrics = train_step(model, build_optimizer(model, cfg), batch, cfg)
        updated.append((metrics, weights(model)))
    (m1, w1), (m2, w2) = updated
    assert m1.loss == pytest.approx(m2.loss, rel=1e-5)
    assert m1.grad_norm == pytest.approx(m2.grad_norm, rel=1e-5)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-5, atol=1e-6)


def test_gradient_clipping_bounds_the_update(model_dir):
    model = load_policy(model_dir, CPU)
    batch = make_batch(model)
    cfg = StepConfig(lr=1.0, max_grad_norm=1e-3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # update = clipped gradient
    before = weights(model)
    metrics = train_step(model, optimizer, batch, cfg)
    moved = torch.sqrt(sum(((weights(model)[n] - before[n]) ** 2).sum() for n in before))
    assert metrics.grad_norm > 1e-3
    assert moved.item() == pytest.approx(1e-3, rel=1e-3)


def test_the_split_over_ranks_is_deterministic_complete_and_balanced():
    rng = random.Random(1)
    lengths = [(rng.randint(1, 20), rng.randint(0, 20)) for _ in range(11)]
    samples = [Sample([1] * p, [2] * c, [0.0] * c, [VersionSpan(0, 0)], 0.0, 0.0, i)
               for i, (p, c) in enumerate(lengths)]
    shares = [rank_samples(samples, r, 3) for r in range(3)]
    assert shares == [rank_samples(samples, r, 3) for r in range(3)]
    assert sorted(s.group for share in shares for s in share) == list(range(11))
    sizes = [sum(len(s.prompt_ids) + len(s.completion_ids) for s in share) for share in shares]
    assert max(sizes) - min(sizes) <= 40  # at most one sample's length apart
    for mb in micro_batches(shares[0], 50):
        longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in mb)
        assert len(mb) == 1 or len(mb) * longest <= 50


# -- checkpoints -------------------------------------------------------------------------------


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
    assert checkpoint.latest(tmp_path) == (3, tmp_path / "step_000003")
    assert checkpoint.load(tmp_path, model, optimizer) == 3

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
