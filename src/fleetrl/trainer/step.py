"""One trainer step: batch `n` in, one optimizer step, policy version `n` out.

Layout of the work:
- Every rank reads the whole batch and takes its share of the samples (sorted by length, dealt
  round-robin: deterministic, and no rank gets more than one sample's worth of extra tokens).
- A rank's share is cut into micro-batches of at most `micro_batch_tokens` (rows x padded
  length), so peak memory is bounded whatever the batch size. Every rank runs the *same number*
  of micro-batches, because each FSDP forward/backward is a collective; a rank that runs out of
  samples runs a zero-weight forward/backward to keep in step.
- Samples are right-padded, not packed. Right padding needs neither an attention mask nor
  position ids (causal attention never lets a real token see the padding after it), so every
  attention kernel works unchanged; sorting by length before cutting micro-batches keeps the
  padding small. Packing several samples into one row would need a block-diagonal mask that
  only some kernels take.
- Only positions that predict completion tokens go through the LM head (`logits_to_keep`):
  the [tokens x vocab] logits are the largest activation of a small model.
- A step whose loss or gradient norm is not finite is not applied (no optimizer step, the
  gradients cleared) and reports `skipped`; every rank decides alike (see `train_step`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fleetrl.batch import Batch, Sample
from fleetrl.trainer import distributed
from fleetrl.trainer.loss import LossConfig, LossStats, policy_loss
from fleetrl.trainer.model import compute_precision

PAD_ID = 0  # any valid id: padding is never attended to by real tokens, and masked out of the loss


@dataclass(frozen=True)
class StepConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096  # rows x padded length of one forward/backward
    loss: LossConfig = field(default_factory=LossConfig)


@dataclass(frozen=True)
class StepMetrics:
    """The floats are what was measured, nan and inf included (see `finite_or_none`)."""

    step: int
    skipped: bool  # the loss or the gradient norm was not finite: the update was not applied
    loss: float
    grad_norm: float  # before clipping
    mismatch_kl: float  # mean k3 KL(inference || trainer) over completion tokens
    ratio_mean: float
    clip_frac: float
    truncated_frac: float
    max_off_policy: int  # the batch's largest off-policy distance, recomputed from its spans
    samples: int
    completion_tokens: int  # the tokens the loss saw (of a multi-turn episode: the model's turns)
    tokens: int  # prompt + completion tokens of the batch: the forward passes' real work
    tokens_per_s: float


def finite_or_none(value: float) -> float | None:
    """`value`, or None when it is nan or infinite: a metrics line is JSON, which has neither."""
    return value if math.isfinite(value) else None


def build_optimizer(model: nn.Module, cfg: StepConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def rank_samples(samples: list[Sample], rank: int, world_size: int) -> list[Sample]:
    """This rank's share of the batch, longest first."""
    order = sorted(range(len(samples)), key=lambda i: (-_length(samples[i]), i))
    return [samples[i] for i in order[rank::world_size]]


def micro_batches(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Consecutive runs of `samples` (longest first) whose padded size fits `max_tokens`;
    a sample longer than that gets a micro-batch of its own."""
    out: list[list[Sample]] = []
    for sample in samples:
        if out and (len(out[-1]) + 1) * _length(out[-1][0]) <= max_tokens:
            out[-1].append(sample)
        else:
            out.append([sample])
    return out


@dataclass
class PaddedBatch:
    """A right-padded micro-batch, cut to the positions whose logits predict completion tokens:
    column j is sequence position `first + j + 1`, predicted from position `first + j`."""

    input_ids: torch.Tensor  # [rows, length]
    keep: torch.Tensor  # [columns]: positions fed to the LM head
    targets: torch.Tensor  # [rows, columns]
    mask: torch.Tensor  # [rows, columns]: 1 on the completion tokens the loss sees
    inference_logprobs: torch.Tensor  # [rows, columns]
    advantages: torch.Tensor  # [rows]


def pad_batch(samples: list[Sample], device: torch.device) -> PaddedBatch:
    if any(not s.prompt_ids for s in samples):
        raise ValueError("a sample has an empty prompt: no position predicts its first token")
    length = max(_length(s) for s in samples)
    first = min(len(s.prompt_ids) for s in samples) - 1
    columns = length - 1 - first
    input_ids = torch.full((len(samples), length), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(samples), columns)
    inference = torch.zeros(len(samples), columns)
    for row, s in enumerate(samples):
        ids = s.prompt_ids + s.completion_ids
        input_ids[row, : len(ids)] = torch.tensor(ids)
        start = len(s.prompt_ids) - 1 - first  # column of the first completion token
        end = start + len(s.completion_ids)
        mask[row, start:end] = 1 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=mask.dtype)
        inference[row, start:end] = torch.tensor(s.inference_logprobs)
    return PaddedBatch(
        input_ids=input_ids.to(device),
        keep=torch.arange(first, length - 1, device=device),
        targets=input_ids[:, first + 1 :].to(device),
        mask=mask.to(device),
        inference_logprobs=inference.to(device),
        advantages=torch.tensor([s.advantage for s in samples], device=device),
    )


def token_logprobs(model: nn.Module, padded: PaddedBatch) -> torch.Tensor:
    """log pi(target) at every kept position, in fp32: [rows, columns]. Untempered: `fleetrl rl`
    samples at temperature 1, the distribution the workers report logprobs of."""
    logits = model(input_ids=padded.input_ids, logits_to_keep=padded.keep).logits.float()
    picked = logits.gather(-1, padded.targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: StepConfig) -> StepMetrics:
    """Trains on `batch` (every rank calls this with the same batch); returns batch-wide metrics."""
    started = time.perf_counter()
    rank, world_size = distributed.rank(), distributed.world_size()
    device = next(model.parameters()).device
    num_tokens = sum(s.trained_tokens() for s in batch.samples)
    if num_tokens == 0:
        raise ValueError(f"batch {batch.step} has no completion tokens to train on")

    plans = [micro_batches(rank_samples(batch.samples, r, world_size), cfg.micro_batch_tokens)
             for r in range(world_size)]
    mine = plans[rank] + [[]] * (max(len(p) for p in plans) - len(plans[rank]))

    model.train()
    sums = torch.zeros(len(fields(LossStats)), dtype=torch.float64, device=device)
    for samples in mine:
        with compute_precision(model, device):
            if samples:
                padded = pad_batch(samples, device)
                logprobs = token_logprobs(model, padded)
                loss, stats = policy_loss(logprobs, padded.inference_logprobs, padded.advantages,
                                          padded.mask, num_tokens, cfg.loss)
                sums += stats.stack()
            else:
                # Nothing left on this rank: a one-token forward whose loss is 0 joins the
                # other ranks' collectives and adds zero gradient.
                logits = model(input_ids=torch.full((1, 1), PAD_ID, device=device)).logits
                loss = logits.sum() * 0.0
        loss.backward()

    grad_norm = clip_grad_norm(model, cfg.max_grad_norm)
    if world_size > 1:
        dist.all_reduce(sums)
    total = LossStats.unstack(sums.cpu())
    # Either every rank skips or none does: a rank that stepped alone would update only its
    # shards of the model. The gradient norm is global already (`clip_grad_norm`), and the loss
    # is summed over the ranks above; a sum keeps a nan or an inf, so one rank's non-finite
    # loss is every rank's.
    skipped = not (math.isfinite(total.loss.item()) and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    all_tokens = sum(_length(s) for s in batch.samples)
    elapsed = time.perf_counter() - started
    return StepMetrics(
        step=batch.step,
        skipped=skipped,
        loss=total.loss.item() / num_tokens,
        grad_norm=grad_norm,
        mismatch_kl=total.mismatch_kl.item() / num_tokens,
        ratio_mean=total.ratio.item() / num_tokens,
        clip_frac=total.clipped.item() / num_tokens,
        truncated_frac=total.truncated.item() / num_tokens,
        max_off_policy=max(batch.distances()),
        samples=len(batch.samples),
        completion_tokens=num_tokens,
        tokens=all_tokens,
        tokens_per_s=all_tokens / elapsed,
    )


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
