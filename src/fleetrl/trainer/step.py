"""One trainer step: batch `n` in, one optimizer step, policy version `n` out. Each group is one
row unit (its prompt once, then its completions, under a 4D mask), dealt to the ranks and cut
into micro-batches of at most `micro_batch_tokens`, every rank running the same number; a step
whose loss or gradient norm is not finite is not applied. The layout and why:
docs/design/trainer.md, "A step's layout"."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fleetrl.batch import Batch, Sample
from fleetrl.config import LossConfig
from fleetrl.records import StepMetrics
from fleetrl.trainer import distributed
from fleetrl.trainer.kept_weights import KeptWeights
from fleetrl.trainer.loss import LossStats, policy_loss, token_entropy
from fleetrl.trainer.mismatch import MismatchSums, mismatch_sums, outliers
from fleetrl.trainer.model import compute_precision
from fleetrl.trainer.schedule import Schedule
from fleetrl.versions import span_ends

PAD_ID = 0  # any valid id: padding is never attended to by real tokens, and masked out of the loss


@dataclass(frozen=True)
class StepConfig:
    schedule: Schedule = field(default_factory=Schedule)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096  # rows x padded length of one forward/backward (a row: one unit)
    loss: LossConfig = field(default_factory=LossConfig)


def finite_or_none(value: float) -> float | None:
    """`value`, or None when it is nan or infinite: a metrics line is JSON, which has neither."""
    return value if math.isfinite(value) else None


def build_optimizer(model: nn.Module, cfg: StepConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train: all of them, or with LoRA the adapter's alone (peft
    froze the rest), so that the optimizer's state is the adapter's."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    return torch.optim.AdamW(trainable, lr=cfg.schedule.lr, weight_decay=cfg.weight_decay)


@dataclass(frozen=True)
class Unit:
    """Samples that share one prompt: a group, or the part of one that fits a micro-batch."""

    prompt_ids: list[int]
    samples: list[Sample]

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + sum(len(s.completion_ids) for s in self.samples)


def prompt_units(samples: list[Sample], max_tokens: int) -> list[Unit]:
    """The samples by shared prompt, in the order groups first appear; a group whose units
    would pass `max_tokens` is split into several, each with the prompt (a single sample
    longer than that gets a unit of its own)."""
    groups: dict[tuple[int, tuple[int, ...]], list[Sample]] = {}
    for sample in samples:
        if not sample.prompt_ids:
            raise ValueError(f"a sample of group {sample.group} has an empty prompt: no position predicts "
                             "its first token")
        groups.setdefault((sample.group, tuple(sample.prompt_ids)), []).append(sample)
    units = []
    for (_, prompt), members in groups.items():
        part: list[Sample] = []
        size = len(prompt)  # the tokens of the unit being filled
        for sample in members:
            if part and size + len(sample.completion_ids) > max_tokens:
                units.append(Unit(list(prompt), part))
                part, size = [], len(prompt)
            part.append(sample)
            size += len(sample.completion_ids)
        units.append(Unit(list(prompt), part))
    return units


def rank_units(units: list[Unit], rank: int, world_size: int) -> list[Unit]:
    """This rank's share of the units, largest first."""
    order = sorted(range(len(units)), key=lambda i: (-units[i].tokens, i))
    return [units[i] for i in order[rank::world_size]]


def micro_batches(units: list[Unit], max_tokens: int) -> list[list[Unit]]:
    """Consecutive runs of `units` (largest first) whose padded size, rows x the first unit's
    tokens, fits `max_tokens`; a larger unit gets a micro-batch of its own."""
    out: list[list[Unit]] = []
    for unit in units:
        if out and (len(out[-1]) + 1) * out[-1][0].tokens <= max_tokens:
            out[-1].append(unit)
        else:
            out.append([unit])
    return out


@dataclass
class PackedBatch:
    """A micro-batch, one row per unit (right-padded), and where its predictions go.

    Row layout: the unit's prompt, then each completion. The loss-side tensors are
    [samples, columns], column k holding completion token k of the sample (samples in unit
    order)."""

    input_ids: torch.Tensor  # [rows, length]
    position_ids: torch.Tensor  # [rows, length]: each completion numbered on from its prompt
    attention: torch.Tensor  # [rows, 1, length, length] bool: True where a query may see a key
    keep: torch.Tensor  # [kept]: positions fed to the LM head (those that predict any token)
    row: torch.Tensor  # [predictions]: each completion token's row,
    kept_at: torch.Tensor  # [predictions]: the index into `keep` of the position predicting it,
    targets: torch.Tensor  # [predictions]: and the token
    sample: torch.Tensor  # [predictions]: where its logprob goes in [samples, columns]
    column: torch.Tensor  # [predictions]
    mask: torch.Tensor  # [samples, columns]: 1 on the completion tokens the loss sees
    inference_logprobs: torch.Tensor  # [samples, columns]
    advantages: torch.Tensor  # [samples]
    lag: torch.Tensor  # [samples, columns]: how many versions each token's is behind the trainer's
    worker: torch.Tensor  # [samples]: the index of the sample's worker in the batch's `workers`


def batch_workers(batch: Batch) -> list[str | None]:
    """The workers that sampled the batch, in one order on every rank (None: a sample that names none)."""
    return sorted({s.worker for s in batch.samples}, key=lambda w: (w is not None, w or ""))


def pack(units: list[Unit], device: torch.device, step: int = 1, workers: list[str | None] = (None,)) -> PackedBatch:
    """`step`: the batch's (the trainer holds version step - 1); `workers`: `batch_workers`."""
    samples = [s for unit in units for s in unit.samples]
    length = max(unit.tokens for unit in units)
    columns = max(1, max(len(s.completion_ids) for s in samples))
    input_ids = torch.full((len(units), length), PAD_ID, dtype=torch.long)
    position_ids = torch.zeros(len(units), length, dtype=torch.long)
    # Per position: which completion of its unit it belongs to (0: the prompt; -1: padding).
    branch = torch.full((len(units), length), -1, dtype=torch.long)
    predict_row, predict_at, targets, sample_of, column_of = [], [], [], [], []
    # fp32 by name, never torch's default dtype: that is the whole process's, and a model load on
    # another thread (user code's) sets it to the model's while it loads (issue 27, item 1).
    mask = torch.zeros(len(samples), columns, dtype=torch.float32)
    inference = torch.zeros(len(samples), columns, dtype=torch.float32)
    lag = torch.zeros(len(samples), columns, dtype=torch.long)
    index = 0
    for row, unit in enumerate(units):
        prompt = len(unit.prompt_ids)
        input_ids[row, :prompt] = torch.tensor(unit.prompt_ids)
        position_ids[row, :prompt] = torch.arange(prompt)
        branch[row, :prompt] = 0
        end = prompt
        for number, s in enumerate(unit.samples, start=1):
            start, size = end, len(s.completion_ids)
            end = start + size
            input_ids[row, start:end] = torch.tensor(s.completion_ids, dtype=torch.long)
            position_ids[row, start:end] = torch.arange(prompt, prompt + size)
            branch[row, start:end] = number
            # Token k is predicted at the position before it: the prompt's last for k = 0.
            predict_row += [row] * size
            predict_at += [prompt - 1, *range(start, end - 1)][:size]
            targets += s.completion_ids
            sample_of += [index] * size
            column_of += range(size)
            mask[index, :size] = 1 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=mask.dtype)
            inference[index, :size] = torch.tensor(s.inference_logprobs, dtype=torch.float32)
            for span, span_end in span_ends(s.spans, size):
                lag[index, span.start:span_end] = (step - 1) - span.version
            index += 1
    position = torch.arange(length)
    causal = position[None, :, None] >= position[None, None, :]  # [1, query, key]
    same_branch = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])
    # Padding (branch -1) sees only padding before it and itself, never a real token; no real
    # token sees it.
    attention = causal & same_branch & ((branch[:, None, :] >= 0) == (branch[:, :, None] >= 0))
    keep = sorted(set(predict_at))
    where = {p: i for i, p in enumerate(keep)}
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return PackedBatch(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention=attention[:, None].to(device),
        keep=as_tensor(keep),
        row=as_tensor(predict_row),
        kept_at=as_tensor([where[p] for p in predict_at]),
        targets=as_tensor(targets),
        sample=as_tensor(sample_of),
        column=as_tensor(column_of),
        mask=mask.to(device),
        inference_logprobs=inference.to(device),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
        lag=lag.to(device),
        worker=as_tensor([workers.index(s.worker) for s in samples]),
    )


def token_logprobs(model: nn.Module, packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(target) of every completion token, in fp32: [samples, columns] (0 past each
    completion's end), and the entropy of pi at each (no gradient: reported, not trained).
    Untempered: `fleetrl rl` samples at temperature 1, the distribution the workers report
    logprobs of."""
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=packed.attention,
                   logits_to_keep=packed.keep).logits
    predicting = logits[packed.row, packed.kept_at].float()  # [predictions, vocab]
    picked = predicting.gather(-1, packed.targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(predicting, dim=-1)
    with torch.no_grad():
        entropy = token_entropy(predicting)
    at = (packed.sample, packed.column)
    out = torch.zeros(packed.mask.shape, dtype=picked.dtype, device=picked.device)
    return out.index_put(at, picked), torch.zeros_like(out).index_put(at, entropy)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: StepConfig,
               previous: KeptWeights | None = None, reference: KeptWeights | None = None) -> StepMetrics:
    """Trains on `batch` (every rank calls this with the same batch); returns batch-wide metrics.

    `previous`: version step - 2's weights, to score the tokens one version behind under their
    own version (trainer/mismatch.py); this step's weights go into it before the update. None
    (k = 0, where no token is behind): mismatch_kl is measured on every token all the same.
    `reference`: the reference model's weights, for the KL penalty (cfg.loss.kl_coef > 0)."""
    started = time.perf_counter()
    rank, world_size = distributed.rank(), distributed.world_size()
    device = next(model.parameters()).device
    num_tokens = sum(s.trained_tokens() for s in batch.samples)
    if num_tokens == 0:
        raise ValueError(f"batch {batch.step} has no completion tokens to train on")

    units = prompt_units(batch.samples, cfg.micro_batch_tokens)
    plans = [micro_batches(rank_units(units, r, world_size), cfg.micro_batch_tokens) for r in range(world_size)]
    mine = plans[rank] + [[]] * (max(len(p) for p in plans) - len(plans[rank]))
    workers = batch_workers(batch)
    # Packed when used, one micro-batch at a time, so that peak memory stays one micro-batch's.
    packing = lambda micro: pack(micro, device, batch.step, workers)  # noqa: E731
    previous_logprobs = score_previous_version(model, previous, batch, plans, packing)
    reference_logprobs = {}
    if cfg.loss.kl_coef > 0:
        if reference is None:
            raise ValueError(f"kl_coef = {cfg.loss.kl_coef} needs the reference model's weights")
        reference_logprobs = logprobs_under(reference, model, mine, packing,
                                            [i for i, micro in enumerate(mine) if micro], len(mine))

    model.train()
    sums = torch.zeros(len(fields(LossStats)), dtype=torch.float64, device=device)
    mismatch = MismatchSums.zeros(len(workers), device)
    for index, micro in enumerate(mine):
        with compute_precision(model, device):
            if micro:
                packed = packing(micro)
                logprobs, entropy = token_logprobs(model, packed)
                loss, stats = policy_loss(logprobs, packed.inference_logprobs, packed.advantages, packed.mask,
                                          num_tokens, cfg.loss, reference_logprobs=reference_logprobs.get(index),
                                          entropy=entropy)
                sums += stats.stack()
                mismatch.add(mismatch_sums(logprobs, previous_logprobs.get(index), packed.inference_logprobs,
                                           packed.lag, packed.mask, packed.worker, len(workers)))
            else:
                loss = idle_forward(model, device)
        loss.backward()

    grad_norm = clip_grad_norm(model, cfg.max_grad_norm)
    flat = torch.cat([sums, mismatch.flat()])
    if world_size > 1:
        dist.all_reduce(flat)
    total = LossStats.unstack(flat[:len(sums)].cpu())
    measured = MismatchSums.from_flat(flat[len(sums):].cpu())
    # Either every rank skips or none does: a rank that stepped alone would update only its
    # shards of the model. The gradient norm is global already (`clip_grad_norm`), and the loss
    # is summed over the ranks above; a sum keeps a nan or an inf, so one rank's non-finite
    # loss is every rank's.
    skipped = not (math.isfinite(total.loss.item()) and math.isfinite(grad_norm))
    lr = cfg.schedule.rate(batch.step)
    if previous is not None:
        previous.remember(model, batch.step - 1)  # even when skipped: version step is step - 1's weights then
    if not skipped:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    all_tokens = sum(_length(s) for s in batch.samples)
    elapsed = time.perf_counter() - started
    per_token = lambda value: value.item() / measured.tokens.item() if measured.tokens.item() else math.nan  # noqa: E731
    per_completion_token = lambda value: finite_or_none(value.item() / num_tokens)  # noqa: E731
    # Samples that name no worker (None) count in the totals only.
    by_worker = {worker: kl / tokens for worker, kl, tokens in zip(
        workers, measured.worker_mismatch_kl.tolist(), measured.worker_tokens.tolist())
        if tokens and worker is not None}
    return StepMetrics(
        skipped=skipped,
        loss=per_completion_token(total.loss),
        grad_norm=finite_or_none(grad_norm),
        lr=lr,
        sampler_kl=per_completion_token(total.sampler_kl),
        mismatch_kl=finite_or_none(per_token(measured.mismatch_kl)),
        staleness_kl=finite_or_none(per_token(measured.staleness_kl)),
        mismatch_tokens=int(measured.tokens.item()),
        worker_mismatch_kl={worker: finite_or_none(kl) for worker, kl in by_worker.items()},
        mismatch_outliers=outliers(by_worker),
        ratio_mean=per_completion_token(total.ratio),
        clip_frac=per_completion_token(total.clipped),
        truncated_frac=per_completion_token(total.truncated),
        masked_frac=per_completion_token(total.masked),
        entropy=per_completion_token(total.entropy),
        ref_kl=per_completion_token(total.ref_kl),
        max_off_policy=max(distances := batch.distances()),
        mean_off_policy=sum(distances) / len(distances),
        samples=len(batch.samples),
        completion_tokens=num_tokens,
        tokens=all_tokens,
        tokens_per_s=all_tokens / elapsed,
    )


def idle_forward(model: nn.Module, device: torch.device) -> torch.Tensor:
    """For a rank with nothing left to train on: a one-token forward whose loss is 0, which
    joins the other ranks' collectives and adds zero gradient (once backpropagated)."""
    return model(input_ids=torch.full((1, 1), PAD_ID, device=device)).logits.sum() * 0.0


def score_previous_version(model: nn.Module, previous: KeptWeights | None, batch: Batch,
                           plans: list[list[list[Unit]]],
                           packing: Callable[[list[Unit]], PackedBatch]) -> dict[int, torch.Tensor]:
    """The logprobs under version step - 2 of this rank's micro-batches that hold a trained
    token of that version, by index in its plan; none where `previous` does not hold it."""
    behind = batch.step - 2
    if previous is None or previous.version != behind:
        return {}

    def holds_behind(micro: list[Unit]) -> bool:
        return any(span.version == behind for unit in micro for s in unit.samples for span in s.trained_spans())

    most = max(sum(map(holds_behind, plan)) for plan in plans)
    if not most:
        return {}
    plan = plans[distributed.rank()]
    return logprobs_under(previous, model, plan, packing, [i for i, micro in enumerate(plan) if holds_behind(micro)],
                          most)


def logprobs_under(weights: KeptWeights, model: nn.Module, micro_batches: list[list[Unit]],
                   packing: Callable[[list[Unit]], PackedBatch], which: list[int],
                   forwards: int) -> dict[int, torch.Tensor]:
    """The logprobs of the micro-batches `which` (indices into `micro_batches`) under `weights`,
    with no gradient. Every rank runs `forwards` forwards (each is a collective on a sharded
    model), those beyond `which` on a one-token input."""
    device = next(model.parameters()).device
    out = {}
    with weights.swapped_in(model), torch.no_grad(), compute_precision(model, device):
        for i in which:
            out[i] = token_logprobs(model, packing(micro_batches[i]))[0]
        for _ in range(forwards - len(which)):
            model(input_ids=torch.full((1, 1), PAD_ID, device=device))
    return out


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clips the global gradient norm to `max_norm`; returns the norm before clipping.

    Sharded gradients give a partial norm per rank; `full_tensor()` combines them, so every
    rank clips by the same global factor.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm.item()


def _length(sample: Sample) -> int:
    return len(sample.prompt_ids) + len(sample.completion_ids)
