"""The policy loss of one batch: token-level importance-weighted policy gradient (GRPO-style).

Samples come from the inference workers' policy mu (the version that sampled them, with the
workers' own numerics), not from the policy pi being trained. Every completion token t is
weighted by the importance ratio r_t = pi(y_t) / mu(y_t) = exp(trainer_lp - inference_lp);
there is no separate "old policy" forward pass, because a trainer step takes exactly one
optimizer step per batch, so pi at the start of the step *is* the old policy.

Two treatments of the ratio, usable together:

- PPO clip (`clip_low`, `clip_high`): a token whose ratio has already moved past
  [1 - clip_low, 1 + clip_high] in the direction its advantage pushes contributes no gradient.
  The upper bound is the wider one (DAPO's "clip higher") so rare good tokens can still grow.
- Truncated importance sampling (`tis_cap`): the ratio's *value* is capped at `tis_cap` and
  detached, so a token the trainer finds far likelier than the sampler did (the usual
  trainer/inference mismatch: other kernels, another dtype, a stale version) cannot dominate
  the gradient. With the clip on too it bounds what PPO leaves unbounded: negative-advantage
  tokens with a large ratio (the role of dual-clip PPO's constant).

Normalization: the per-token losses are summed over every completion token of the whole batch
and divided by that batch's completion-token count (`num_tokens`), given by the caller. Each
token weighs the same whatever its sample's length (a per-sample mean would give a token of a
long completion less weight than one of a short completion, biasing toward short answers), and
because the divisor is a constant of the batch rather than of a micro-batch or a rank, the
gradient summed over micro-batches and ranks is the same however the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# |log pi/mu| above this is a broken sample (a sampler mismatch of 10^8), not a policy that
# moved: such a token's log-ratio is clamped, so it carries no gradient (the clamp's gradient
# is 0), as a token past the PPO clip carries none. Far above any useful clip or cap.
MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossConfig:
    """Each treatment turns off at a value rather than at None, so a config survives a round
    trip through TOML (which has no null but has `inf`)."""

    clip_low: float = 0.2  # ratio floor 1 - clip_low; 1 turns it off (a ratio is never negative)
    clip_high: float = 0.28  # ratio ceiling 1 + clip_high; inf turns it off
    tis_cap: float = 2.0  # the largest weight a token's ratio may carry; inf turns it off

    def __post_init__(self) -> None:
        if not 0 <= self.clip_low <= 1:
            raise ValueError(f"clip_low must be in [0, 1], got {self.clip_low}")
        if not self.clip_high >= 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")


@dataclass
class LossStats:
    """Sums over completion tokens (0-d tensors, so micro-batches and ranks can add them
    without a device sync); divide by `tokens` for means."""

    tokens: torch.Tensor
    loss: torch.Tensor  # sum of per-token losses (before dividing by num_tokens)
    ratio: torch.Tensor
    mismatch_kl: torch.Tensor  # k3 estimate of KL(mu || pi), per token
    clipped: torch.Tensor  # tokens whose gradient the PPO clip removed
    truncated: torch.Tensor  # tokens whose ratio the TIS cap lowered

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
) -> tuple[torch.Tensor, LossStats]:
    """The batch loss contributed by these rows, and their token statistics.

    trainer_logprobs, inference_logprobs, mask: [rows, tokens] (mask is 1 on completion tokens);
    advantages: [rows], one per sample (the orchestrator normalized them within each group);
    num_tokens: completion tokens of the *whole* batch (every micro-batch of every rank).
    """
    keep = mask.bool()
    mask = mask.to(trainer_logprobs.dtype)
    inference_logprobs = inference_logprobs.to(trainer_logprobs.dtype)
    adv = advantages.to(trainer_logprobs.dtype).unsqueeze(-1)
    # Padding may hold anything (even -inf): select, never multiply, so no nan gets through.
    # The bound keeps the ratio finite: exp overflows fp32 past a log-ratio of 88, and an inf
    # ratio meets a zero advantage or the TIS factor (cap / inf = 0) in a product, 0 x inf = nan.
    log_ratio = torch.where(keep, trainer_logprobs - inference_logprobs, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)

    clipped_surrogate = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    surrogate = torch.minimum(ratio * adv, clipped_surrogate)
    clipped = clipped_surrogate < ratio * adv  # the min picked the constant: no gradient

    value = ratio.detach()
    truncated = value > cfg.tis_cap
    # Scales value and gradient alike: the token's weight becomes min(r, cap) instead of r.
    surrogate = surrogate * torch.where(truncated, cfg.tis_cap / value, 1.0)

    token_loss = -surrogate * mask
    loss = token_loss.sum() / num_tokens

    with torch.no_grad():
        # k3 = r - 1 - log r, with r = pi/mu on tokens sampled from mu: an unbiased,
        # non-negative estimate of KL(mu || pi), zero exactly when the logprobs agree.
        k3 = (ratio.detach() - 1 - log_ratio.detach()) * mask
        stats = LossStats(
            tokens=mask.sum(),
            loss=token_loss.detach().sum(),
            ratio=(ratio.detach() * mask).sum(),
            mismatch_kl=k3.sum(),
            clipped=(clipped.to(mask.dtype) * mask).sum(),
            truncated=(truncated.to(mask.dtype) * mask).sum(),
        )
    return loss, stats
