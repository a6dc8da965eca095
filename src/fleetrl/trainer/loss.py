"""The policy loss of one batch: importance-weighted policy gradient (GRPO-style), each token
weighted by its ratio pi/mu to the worker that sampled it, with the PPO clip and a TIS cap by
default and a menu of other treatments of the ratio (sequence-level TIS, masked importance
sampling, GSPO's sequence ratio, a k3 KL penalty), normalized by the batch's completion-token
count so that any split into micro-batches and ranks gives the same gradient. Its options are
the `[trainer.loss]` section, read as it is. The math and the reasons: docs/design/trainer.md,
"The loss"; when to pick each option: docs/config.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from fleetrl.config import LossConfig

# |log pi/mu| above this is a broken sample (a sampler mismatch of 10^8), not a policy that
# moved: such a token's log-ratio is clamped, so it carries no gradient (the clamp's gradient
# is 0), as a token past the PPO clip carries none. Far above any useful clip or cap.
MAX_LOG_RATIO = 20.0


@dataclass
class LossStats:
    """Sums over completion tokens (0-d tensors, so micro-batches and ranks can add them
    without a device sync); divide by `tokens` for means. What an option that is off would
    count is 0."""

    tokens: torch.Tensor
    loss: torch.Tensor  # sum of per-token losses (before dividing by num_tokens)
    ratio: torch.Tensor  # each token's own ratio pi/mu, whatever ratio_level
    sampler_kl: torch.Tensor  # k3 estimate of KL(mu || pi), per token: mismatch and staleness together
    clipped: torch.Tensor  # tokens whose gradient the PPO clip removed
    truncated: torch.Tensor  # tokens whose weight the TIS cap lowered (sequence level: of a capped sample)
    masked: torch.Tensor  # tokens MIS dropped
    ref_kl: torch.Tensor  # k3 estimate of KL(pi || reference), per token; 0 without reference logprobs
    entropy: torch.Tensor  # entropy of pi, per token; 0 without the entropy

    def stack(self) -> torch.Tensor:
        """All sums in one float64 tensor: one collective reduces them all."""
        return torch.stack([getattr(self, f.name).detach().double() for f in fields(self)])

    @classmethod
    def unstack(cls, sums: torch.Tensor) -> LossStats:
        return cls(*sums.unbind())


def policy_loss(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int,
    cfg: LossConfig,
    *,
    reference_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The batch loss contributed by these rows, and their token statistics.

    trainer_logprobs, inference_logprobs, mask: [rows, tokens] (mask is 1 on completion tokens);
    advantages: [rows], one per sample (the orchestrator normalized them within each group);
    num_tokens: completion tokens of the *whole* batch (every micro-batch of every rank);
    reference_logprobs: [rows, tokens], the reference model's (needed when cfg.kl_coef > 0);
    entropy: [rows, tokens], the entropy of pi at each token (reported only). A row is one whole
    sample: the sequence-level options take all of a sample's tokens to be in this call.
    """
    if cfg.kl_coef > 0 and reference_logprobs is None:
        raise ValueError(f"kl_coef = {cfg.kl_coef} needs reference_logprobs, the reference model's logprobs "
                         "of the same tokens")
    keep = mask.bool()
    mask = mask.to(trainer_logprobs.dtype)
    inference_logprobs = inference_logprobs.to(trainer_logprobs.dtype)
    adv = advantages.to(trainer_logprobs.dtype).unsqueeze(-1)
    # Padding may hold anything (even -inf): select, never multiply, so no nan gets through.
    # The bound keeps the ratio finite: exp overflows fp32 past a log-ratio of 88, and an inf
    # ratio meets a zero advantage or the TIS factor (cap / inf = 0) in a product, 0 x inf = nan.
    log_ratio = torch.where(keep, trainer_logprobs - inference_logprobs, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    token_ratio = torch.exp(log_ratio)

    dropped = _mis_dropped(log_ratio.detach(), keep, cfg)
    live = keep & ~dropped
    live_mask = torch.where(dropped, 0.0, mask)
    # GSPO: the value exp(mean log r) on every token of the sample, the gradient of the mean.
    ratio = (torch.exp(_sample_mean(log_ratio, live)).expand_as(log_ratio) if cfg.ratio_level == "sequence"
             else token_ratio)

    clipped_surrogate = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    surrogate = torch.minimum(ratio * adv, clipped_surrogate)
    clipped = clipped_surrogate < ratio * adv  # the min picked the constant: no gradient

    value = ratio.detach()
    if cfg.tis_level == "token":
        truncated = value > cfg.tis_cap
        # Scales value and gradient alike: the token's weight becomes min(r, cap) instead of r.
        surrogate = surrogate * torch.where(truncated, cfg.tis_cap / value, 1.0)
    else:
        # The weight becomes the sample's min(prod r, cap), taken in logs: the product overflows.
        log_product = torch.where(live, log_ratio.detach(), 0.0).sum(-1, keepdim=True)
        truncated = (log_product > math.log(cfg.tis_cap)).expand_as(value)
        surrogate = surrogate * (torch.exp(log_product.clamp(max=math.log(cfg.tis_cap))) / value)

    token_loss = -surrogate * live_mask
    ref_k3 = None
    if reference_logprobs is not None:
        # k3 of KL(pi || ref), with r = ref/pi.
        ref_k3 = k3(torch.where(keep, reference_logprobs.to(trainer_logprobs.dtype) - trainer_logprobs, 0.0))
        token_loss = token_loss + cfg.kl_coef * ref_k3 * live_mask
    loss = token_loss.sum() / num_tokens

    with torch.no_grad():
        token_ratio = token_ratio.detach()
        # k3 of KL(mu || pi), with r = pi/mu on tokens sampled from mu; clamped at 0, where it is by
        # definition: in fp32 r - 1 - log r rounds to -1e-10 near r = 1.
        sampler_k3 = k3(log_ratio.detach()).clamp(min=0) * mask
        zero = mask.new_zeros(())
        stats = LossStats(
            tokens=mask.sum(),
            loss=token_loss.detach().sum(),
            ratio=(token_ratio * mask).sum(),
            sampler_kl=sampler_k3.sum(),
            clipped=(clipped.to(mask.dtype) * live_mask).sum(),
            truncated=(truncated.to(mask.dtype) * live_mask).sum(),
            masked=(dropped.to(mask.dtype) * mask).sum(),
            ref_kl=zero if ref_k3 is None else (ref_k3.detach() * mask).sum(),
            entropy=zero if entropy is None else torch.where(keep, entropy.detach().to(mask.dtype), 0.0).sum(),
        )
    return loss, stats


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """r - 1 - log r of log r = log(p/q), bounded by MAX_LOG_RATIO: Schulman's k3, an unbiased,
    non-negative estimate of KL(q || p) for tokens drawn from q, 0 exactly where they agree."""
    log_ratio = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio) - 1 - log_ratio


def _sample_mean(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Each row's mean of `values` over `where`: [rows, 1] (0 for a row with none)."""
    return torch.where(where, values, 0.0).sum(-1, keepdim=True) / where.sum(-1, keepdim=True).clamp(min=1)


def _mis_dropped(log_ratio: torch.Tensor, keep: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """The trained tokens masked importance sampling drops: [rows, tokens] bool. None with the
    band off (every ratio lies in (0, inf)); padding's ratio is 1, always inside the band."""
    ratio = torch.exp(_sample_mean(log_ratio, keep) if cfg.mis_level == "geometric" else log_ratio)
    outside = (ratio < cfg.mis_low) | (ratio > cfg.mis_high)
    if cfg.mis_level == "sequence":
        outside = outside.any(-1, keepdim=True)
    return outside & keep


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of softmax(logits) over the last dimension, in fp32: [..., vocab] -> [...].
    Given the rows from which `step.token_logprobs` takes each completion token's logprob, the
    entropy `policy_loss` reports; call it under torch.no_grad() for that."""
    return torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(-1)
