"""The trainer step and the training loop on a tiny random Llama (fp32, CPU, one rank)."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import fields, replace

import pytest
import torch

from fleetrl.batch import Batch, Sample
from fleetrl.config import LossConfig, load_config
from fleetrl.errors import FleetrlError
from fleetrl.rundir import RunDir
from fleetrl.trainer import checkpoint, loop, step
from fleetrl.trainer.distributed import World
from fleetrl.trainer.loop import Hooks
from fleetrl.trainer.loss import LossStats
from fleetrl.trainer.kept_weights import KeptWeights
from fleetrl.trainer.model import load_policy, named_tensors, prompt_logprobs
from fleetrl.trainer.schedule import Schedule
from fleetrl.trainer.step import (StepConfig, build_optimizer, finite_or_none, micro_batches, pack, prompt_units,
                                  rank_units, token_logprobs, train_step)
from fleetrl.versions import VersionSpan

VOCAB = 128
CPU = torch.device("cpu")
FAST = StepConfig(schedule=Schedule(lr=1e-3), max_grad_norm=1.0, micro_batch_tokens=64)


def save_tiny_model(path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)  # tied, like SmolLM2
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def save_tiny_tokenizer(path) -> None:
    """A word-level tokenizer for the tiny model ("w5 w7" -> [5, 7]), as any base model folder has
    one (what export copies)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(path)


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


def test_a_groups_prompt_is_packed_once_and_each_completion_gets_its_plain_forwards_logprobs(model_dir):
    model = load_policy(model_dir, CPU)
    batch = make_batch(model, samples=8)
    units = prompt_units(batch.samples, 10_000)
    assert [len(u.samples) for u in units] == [2, 2, 2, 2]  # one unit per group, its prompt once
    assert [u.tokens for u in units] == [len(u.prompt_ids) + sum(len(s.completion_ids) for s in u.samples)
                                         for u in units]
    packed = pack(units, CPU)
    assert packed.input_ids.shape == (4, max(u.tokens for u in units))
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, packed)
    for row, sample in enumerate(s for u in units for s in u.samples):
        size = len(sample.completion_ids)
        torch.testing.assert_close(logprobs[row, :size], torch.tensor(reference_logprobs(model, sample)),
                                   rtol=0, atol=1e-5)
        assert not logprobs[row, size:].any()


def test_packed_logprobs_agree_with_a_plain_forward(model_dir):
    model = load_policy(model_dir, CPU)
    batch = make_batch(model)
    metrics = train_step(model, build_optimizer(model, FAST), batch, FAST)
    # The sampler's logprobs equal the trainer's: packing, masks, positions and columns are right.
    assert metrics.mismatch_kl == pytest.approx(0.0, abs=1e-9)
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert metrics.clip_frac == 0 and metrics.truncated_frac == 0
    assert metrics.samples == 6
    assert metrics.completion_tokens == sum(len(s.completion_ids) for s in batch.samples)
    assert metrics.tokens == metrics.completion_tokens + sum(len(s.prompt_ids) for s in batch.samples)
    assert metrics.max_off_policy == 0
    assert metrics.grad_norm > 0 and metrics.tokens_per_s > 0


def test_a_step_is_fp32_whatever_torchs_default_dtype_another_thread_set(model_dir):
    """torch's default dtype is the process's: a model load on another thread (a reward's judge
    model: transformers sets the default to the model's dtype while it loads, and two such loads
    at once can leave it set) changes it under the training loop (issue 27, item 1). The step's
    float tensors (the workers' logprobs, the loss mask, the advantages) stay fp32: in bf16 the
    workers' logprobs kept 3 significant digits and every ratio was off."""
    model = load_policy(model_dir, CPU)
    batch = make_batch(model)
    units = prompt_units(batch.samples, 10_000)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        packed = pack(units, CPU)
        metrics = train_step(model, build_optimizer(model, FAST), batch, FAST)
    finally:
        torch.set_default_dtype(default)
    assert {packed.mask.dtype, packed.inference_logprobs.dtype, packed.advantages.dtype} == {torch.float32}
    first = batch.samples[0]
    assert packed.inference_logprobs[0, :len(first.completion_ids)].tolist() == pytest.approx(
        first.inference_logprobs, abs=1e-6)
    assert metrics.mismatch_kl == pytest.approx(0.0, abs=1e-9)
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-6)


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
    cfg = StepConfig(schedule=Schedule(lr=1.0), max_grad_norm=1e-3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # update = clipped gradient
    before = weights(model)
    metrics = train_step(model, optimizer, batch, cfg)
    moved = torch.sqrt(sum(((weights(model)[n] - before[n]) ** 2).sum() for n in before))
    assert metrics.grad_norm > 1e-3
    assert moved.item() == pytest.approx(1e-3, rel=1e-3)


def test_the_split_over_ranks_is_deterministic_complete_and_balanced():
    rng = random.Random(1)
    samples = []
    for group in range(11):
        prompt = [1 + group] * rng.randint(1, 20)
        for _ in range(rng.randint(1, 4)):
            c = rng.randint(0, 20)
            samples.append(Sample(prompt, [2] * c, [0.0] * c, [VersionSpan(0, 0)], 0.0, 0.0, group))
    units = prompt_units(samples, 40)
    assert all(u.tokens <= 40 or len(u.samples) == 1 for u in units)  # a group too long is split
    assert sorted(id(s) for u in units for s in u.samples) == sorted(id(s) for s in samples)
    shares = [rank_units(units, r, 3) for r in range(3)]
    assert shares == [rank_units(units, r, 3) for r in range(3)]
    assert sorted(id(s) for share in shares for u in share for s in u.samples) == sorted(id(s) for s in samples)
    sizes = [sum(u.tokens for u in share) for share in shares]
    assert max(sizes) - min(sizes) <= max(u.tokens for u in units)  # at most one unit apart
    for mb in micro_batches(shares[0], 50):
        assert len(mb) == 1 or len(mb) * mb[0].tokens <= 50


# -- numbers that are not finite ---------------------------------------------------------------


def poisoned(batch: Batch) -> Batch:
    """`batch` with one nan inference logprob: what a worker with broken numerics returns."""
    samples = list(batch.samples)
    first = samples[0]
    samples[0] = replace(first, inference_logprobs=[math.nan, *first.inference_logprobs[1:]])
    return replace(batch, samples=samples)


def test_a_step_with_a_nan_loss_is_not_applied_and_the_next_one_is(model_dir):
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, FAST)
    batch = make_batch(model)
    before = weights(model)
    metrics = train_step(model, optimizer, poisoned(batch), FAST)
    # The loss is nan; the gradient is not (the loss's clamp passes no gradient to a nan), and
    # the step is skipped all the same.
    assert metrics.skipped and metrics.loss is None and metrics.grad_norm is not None  # None: not finite
    assert finite_or_none(math.nan) is None and finite_or_none(1.5) == 1.5
    assert metrics.samples == 6 and metrics.completion_tokens > 0  # the rest is still reported
    for name, tensor in weights(model).items():
        assert torch.equal(tensor, before[name]), name
    assert all(p.grad is None for p in model.parameters())  # nothing left for the next step
    assert not optimizer.state  # AdamW never saw the nan

    following = train_step(model, optimizer, batch, FAST)
    assert not following.skipped and math.isfinite(following.loss)
    assert all(not torch.equal(tensor, before[name]) for name, tensor in weights(model).items())


def test_a_gradient_norm_that_is_not_finite_skips_the_step(model_dir, monkeypatch):
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, FAST)
    monkeypatch.setattr(step, "clip_grad_norm", lambda model, max_norm: math.inf)
    before = weights(model)
    metrics = train_step(model, optimizer, make_batch(model), FAST)
    assert metrics.skipped and metrics.loss is not None
    for name, tensor in weights(model).items():
        assert torch.equal(tensor, before[name]), name


def test_another_ranks_nan_loss_stops_this_ranks_update(model_dir, monkeypatch):
    """Rank 0 of 2, its own share finite: the loss sum reduced over the ranks carries rank 1's
    nan, so rank 0 skips as rank 1 does."""
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, FAST)
    batch = make_batch(model)
    loss_sum = [f.name for f in fields(LossStats)].index("loss")  # where the sums put it
    monkeypatch.setattr(step.distributed, "world_size", lambda: 2)
    monkeypatch.setattr(step.dist, "all_reduce", lambda sums: sums[loss_sum].add_(math.nan))
    before = weights(model)
    metrics = train_step(model, optimizer, batch, FAST)
    assert metrics.skipped and metrics.grad_norm is not None
    for name, tensor in weights(model).items():
        assert torch.equal(tensor, before[name]), name


def test_the_kl_penalty_scores_the_batch_under_the_reference_weights(model_dir):
    """trainer.loss.kl_coef: the reference is the base model, kept as the trainer loads; at v0 the
    policy is the reference (k3 = 0 on every token), after an update it is not."""
    cfg = replace(FAST, loss=LossConfig(kl_coef=0.1))
    model = load_policy(model_dir, CPU)
    reference = KeptWeights()
    reference.remember(model, 0)
    optimizer = build_optimizer(model, cfg)
    first = train_step(model, optimizer, make_batch(model, seed=1), cfg, reference=reference)
    second = train_step(model, optimizer, make_batch(model, seed=2, step=2), cfg, reference=reference)
    assert first.ref_kl == pytest.approx(0.0, abs=1e-9) and second.ref_kl > 1e-6
    with pytest.raises(ValueError, match="kl_coef"):
        train_step(model, optimizer, make_batch(model, seed=3, step=3), cfg)


def test_entropy_is_the_policys_over_the_completion_tokens(model_dir):
    model = load_policy(model_dir, CPU)
    batch = make_batch(model)
    metrics = train_step(model, build_optimizer(model, FAST), batch, FAST)
    # A random tiny model is close to uniform over its 128 tokens: entropy just under log 128.
    assert 0.9 * math.log(128) < metrics.entropy <= math.log(128)


# -- the loop ----------------------------------------------------------------------------------


class Run:
    """`loop.train` on one rank with hooks that record what it publishes and reports."""

    def __init__(self, model_dir, tmp_path, poisoned_steps=(), **trainer):
        overrides = [("run.max_steps", "3"), ("trainer.lr", "1e-3"), ("trainer.checkpoint_interval", "1"),
                     *((f"trainer.{k}", str(v)) for k, v in trainer.items())]
        self.config = load_config([], overrides)
        self.run_dir = RunDir(tmp_path)
        self.model_dir = model_dir
        reference = load_policy(model_dir, CPU)
        self.batches = {s: make_batch(reference, seed=s, step=s) for s in (1, 2, 3)}
        for s in poisoned_steps:
            self.batches[s] = poisoned(self.batches[s])
        self.published: dict[int, dict[str, torch.Tensor]] = {}
        self.probes: dict[int, tuple[list[int], list[float]]] = {}
        self.metrics = []
        self.steps = []  # the step of each of metrics
        self.lines = []
        self.checkpointed_at_on_step = []

    def publish(self, version, weights, probe_ids, reference):
        self.published[version] = weights
        self.probes[version] = (probe_ids, reference)
        return f"report {version}"

    def on_step(self, batch, metrics, report, started, finished):
        assert report == f"report {batch.step}"
        self.metrics.append(metrics)
        self.steps.append(batch.step)
        latest = checkpoint.latest(self.run_dir.checkpoints_dir)
        self.checkpointed_at_on_step.append(latest[0] if latest else 0)

    def hand_start_weights(self, version, weights, probe_ids, reference):
        self.start = version, weights, probe_ids, reference

    def train(self):
        hooks = Hooks(wait_batch=self.batches.__getitem__, publish=self.publish,
                      start_weights=self.hand_start_weights, on_step=self.on_step)
        loop.train(self.config, self.run_dir, self.model_dir, World(0, 1, CPU), hooks, log=self.lines.append)


def test_a_nonfinite_step_stops_the_run_by_default_naming_the_step(model_dir, tmp_path):
    run = Run(model_dir, tmp_path, poisoned_steps=[2])
    with pytest.raises(FleetrlError, match=r"^step 2: loss is not finite; the update was not applied .*"
                                           r"trainer\.on_nonfinite = skip") as error:
        run.train()
    assert "\n" not in str(error.value)
    assert sorted(run.published) == [1]  # nothing was published for step 2
    assert run.steps == [1]
    assert checkpoint.latest(run.run_dir.checkpoints_dir)[0] == 1


def test_a_skipped_step_still_publishes_its_version_with_the_weights_unchanged(model_dir, tmp_path):
    run = Run(model_dir, tmp_path, poisoned_steps=[2], on_nonfinite="skip")
    run.train()
    assert sorted(run.published) == [1, 2, 3]  # versions stay one per step
    for name, tensor in run.published[1].items():
        assert torch.equal(run.published[2][name], tensor), name
        assert not torch.equal(run.published[3][name], tensor), name
    assert [m.skipped for m in run.metrics] == [False, True, False]
    assert any(line.startswith("fleetrl: step 2: loss is not finite") and "skipped" in line for line in run.lines)


def test_the_metrics_line_of_a_step_comes_before_its_checkpoint(model_dir, tmp_path):
    run = Run(model_dir, tmp_path)
    run.train()
    # When step n's metrics are reported, the newest checkpoint is still step n - 1's.
    assert run.checkpointed_at_on_step == [0, 1, 2]
    assert checkpoint.latest(run.run_dir.checkpoints_dir)[0] == 3


def train_step_then_break_a_weight(model, *args):
    """`train_step`, after which one weight is inf."""
    metrics = train_step(model, *args)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.inf
    return metrics


def test_weights_that_are_not_finite_are_never_published(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "train_step", train_step_then_break_a_weight)
    run = Run(model_dir, tmp_path)
    with pytest.raises(FleetrlError, match=r"^step 1: weight model\.layers\.1\.mlp\.down_proj\.weight is not "
                                           r"finite; version 1 not published"):
        run.train()
    assert not run.published and not run.metrics
    assert checkpoint.latest(run.run_dir.checkpoints_dir) is None


def test_the_agreement_probe_goes_out_with_the_logprobs_of_the_published_weights(model_dir, tmp_path):
    """What each worker's probe is compared with after a publish: the logprobs of exactly the
    weights published as that version (a worker holding them agrees to float precision)."""
    run = Run(model_dir, tmp_path)
    run.train()
    assert sorted(run.probes) == [1, 2, 3]
    served = load_policy(model_dir, CPU)
    for version in (1, 3):
        probe_ids, reference = run.probes[version]
        assert len(probe_ids) > 5 and len(reference) == len(probe_ids) - 1
        served.load_state_dict(run.published[version], strict=False)
        assert prompt_logprobs(served, probe_ids, CPU) == pytest.approx(reference, abs=1e-5)
    assert run.probes[1][1] != pytest.approx(run.probes[3][1], abs=1e-6)  # training moved them


@pytest.mark.parametrize("attaches", [True, False], ids=["attached workers", "launched workers"])
def test_attached_workers_get_the_base_weights_from_the_trainers_own_copy(model_dir, tmp_path, monkeypatch,
                                                                          attaches):
    """The base weights attached workers are held to come from the model the trainer loaded,
    copied before step 1 changes it: one model load in the process, never a second one beside
    the trainer's (the race of issue 25). Launched workers start from the model folder: nothing
    is handed."""
    run = Run(model_dir, tmp_path)
    if attaches:
        run.config.inference.urls = ["http://127.0.0.1:1"]
    loads = []
    monkeypatch.setattr(loop, "load_policy", lambda *a, **k: loads.append(a) or load_policy(*a, **k))
    run.train()
    assert len(loads) == 1
    if not attaches:
        assert not hasattr(run, "start")
        return
    version, weights, probe_ids, reference = run.start
    assert version == 0
    base = load_policy(model_dir, CPU)
    for name, tensor in named_tensors(base):
        assert torch.equal(weights[name], tensor), name  # the base, not the weights step 3 left
    assert probe_ids == run.probes[1][0]
    assert prompt_logprobs(base, probe_ids, CPU) == pytest.approx(reference, abs=1e-6)


@pytest.mark.parametrize("attaches", [True, False], ids=["attached workers", "launched workers"])
def test_a_resumed_run_brings_the_fleet_to_the_checkpoints_version_before_any_rollout(model_dir, tmp_path,
                                                                                      attaches):
    """Attached workers are held to the checkpoint's weights at its version as the fleet starts,
    and nothing is published for it: a worker the killed run left there is sent nothing, one
    elsewhere is refitted once, not to the base first and then to the checkpoint. Launched
    workers start at the base: the checkpoint's version is published to them."""
    first = Run(model_dir, tmp_path)
    first.config.run.max_steps = 2
    first.train()
    run = Run(model_dir, tmp_path)
    if attaches:
        run.config.inference.urls = ["http://127.0.0.1:1"]
    run.train()
    assert sorted(run.published) == ([3] if attaches else [2, 3])
    if not attaches:
        assert not hasattr(run, "start")
        return
    version, weights, probe_ids, reference = run.start
    assert version == 2
    for name, tensor in first.published[2].items():
        assert torch.equal(weights[name], tensor), name
    assert reference == pytest.approx(first.probes[2][1], abs=1e-6)


def test_the_learning_rate_schedule_survives_a_resume_exactly(model_dir, tmp_path):
    """A run killed after step 2 and resumed gives step 3 the rate, and the weights, of a run
    that was never stopped: the rate is the step's alone, not the checkpointed optimizer's."""
    schedule = {"lr_warmup_steps": 1, "lr_decay": "cosine", "lr_min": 1e-4}
    whole = Run(model_dir, tmp_path / "whole", **schedule)
    whole.train()
    killed = Run(model_dir, tmp_path / "resumed", **schedule)
    del killed.batches[3]  # the run dies waiting for batch 3, its checkpoint at step 2
    with pytest.raises(KeyError):
        killed.train()
    resumed = Run(model_dir, tmp_path / "resumed", **schedule)
    resumed.train()
    rates = [m.lr for m in whole.metrics]
    assert rates == pytest.approx([1e-3, 1e-3, 0.5 * (1e-3 + 1e-4)])  # warmup's end, then cosine over 2 steps
    assert [m.lr for m in killed.metrics + resumed.metrics] == rates
    for name, tensor in whole.published[3].items():
        assert torch.equal(resumed.published[3][name], tensor), name


def test_the_fleet_takes_the_handed_start_weights_once_and_a_stopped_run_releases_its_wait(tmp_path):
    """`RLRun.take_start_weights` (the fleet's start, on the control loop) gets what the training loop
    handed, and nothing keeps it after; a run that stops before the trainer handed anything
    ends that wait with one line instead of leaving a thread blocked."""
    from fleetrl.app.rl import RLRun

    run = RLRun(load_config([], [("run.dir", str(tmp_path / "handed"))]), log=lambda *_: None)
    run.transport = None
    try:
        run.hand_start_weights(4, {"w": torch.ones(2)}, [1, 2, 3], [-0.5, -0.25])
        source = asyncio.run(run.take_start_weights())
        assert source.probe.token_ids == [1, 2, 3] and dict(source.named_tensors())["w"].sum() == 2
        assert source.version == 4 and run.start_weights.empty()
    finally:
        run.control.stop()
    stopped = RLRun(load_config([], [("run.dir", str(tmp_path / "stopped"))]), log=lambda *_: None)
    stopped.stop()
    with pytest.raises(FleetrlError, match="^the run stopped before the trainer handed the fleet the weights it "
                                           "starts from$"):
        asyncio.run(stopped.take_start_weights())


def test_the_collective_timeout_covers_the_longest_legal_publish():
    """Not a fixed 600 s: a rank waits for rank 0's fleet start, one publish (admin calls with
    their retries and the backoff between them, transfer steps) and a train step, whatever the
    config makes of them."""
    from fleetrl.trainer.distributed import TRAIN_STEP_BOUND_S, collective_timeout_s

    default = load_config([], [])
    slow = load_config([], [("inference.weights.transfer_timeout_s", "3600"), ("inference.admin_retries", "5")])
    i = default.inference
    backoff_s = 0.5 + 1.0  # after the first try and the second: admin_retries = 2
    assert collective_timeout_s(default) == (i.startup_timeout_s + 3 * (i.admin_timeout_s * (i.admin_retries + 1) + backoff_s)
                                             + 4 * i.weights.transfer_timeout_s + TRAIN_STEP_BOUND_S)
    assert collective_timeout_s(slow) > collective_timeout_s(default) + 4 * (3600 - 600)


def test_a_control_loop_that_ended_fails_every_wait_with_one_line():
    """What escapes a task (a SystemExit, say) ends the loop's thread; a wait on it then named
    nothing and never returned, and the run hung past SIGTERM."""
    import asyncio

    from fleetrl.app.rl import ControlLoop

    control = ControlLoop()

    async def escape():
        raise SystemExit(3)

    control.submit(escape())
    control.thread.join(10)
    assert not control.thread.is_alive()
    with pytest.raises(FleetrlError, match=r"^the control loop \(the fleet and the rollouts\) has ended: SystemExit: 3$"):
        control.run(asyncio.sleep(3600))
