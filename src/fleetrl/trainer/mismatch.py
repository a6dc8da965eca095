"""How far the sampler is from the trainer, apart from how far the policy moved.

The importance ratio of the loss compares the policy being trained (version n - 1 at step n)
with the worker that sampled each token, at the token's own version v. That distance mixes two
things that mean different things, so each step reports them apart, as k3 estimates over the
completion tokens the loss sees (k3 = r - 1 - log r, unbiased for tokens drawn from the first
distribution, never negative, 0 exactly where the logprobs agree):

- `mismatch_kl`, KL(worker at v || trainer at v): the engines' numerics (kernels, dtype,
  batching) and nothing else, unless the sync is broken, e.g. a worker serving other weights
  than its label says. fp32 on CPU keeps it at most 1e-6. Per worker too: one whose figure
  stands out is named in the step's log.
- `staleness_kl`, KL(trainer at v || trainer at n - 1): the policy's own movement between the
  sampling version and the one being trained. 0 at k = 0; at k >= 1, what off-policy costs.

Scoring a token under its own version: tokens of version n - 1 take the training forward's
logprobs. Tokens one version behind need version n - 2's weights: the step keeps this rank's
parameters as they were before the last update (`KeptWeights`, only when k >= 1) and swaps them
in for a no-grad forward of the micro-batches that hold such tokens. Tokens older still
(k >= 2), and the first step after a resume's tokens one version behind (the checkpoint has no
previous version), are not measured: `mismatch_tokens` counts those that are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetrl.trainer.loss import k3

# A worker's mismatch stands out when it is above this and OUTLIER_FACTOR times the others'
# median: above fp32's agreement by orders of magnitude (about 1e-9 on CPU, measured), and clear
# of bf16 engines' ordinary spread (1e-4 to 1e-3 in peers' reports).
OUTLIER_KL = 1e-3
OUTLIER_FACTOR = 10.0


@dataclass
class MismatchSums:
    """Sums over the measured tokens (0-d tensors, and per worker [workers] tensors, so ranks
    add them in one collective); divide by `tokens` for means."""

    tokens: torch.Tensor
    mismatch_kl: torch.Tensor
    staleness_kl: torch.Tensor
    worker_tokens: torch.Tensor
    worker_mismatch_kl: torch.Tensor

    @classmethod
    def zeros(cls, workers: int, device: torch.device) -> MismatchSums:
        scalar = lambda: torch.zeros((), dtype=torch.float64, device=device)  # noqa: E731
        return cls(scalar(), scalar(), scalar(), torch.zeros(workers, dtype=torch.float64, device=device),
                   torch.zeros(workers, dtype=torch.float64, device=device))

    def flat(self) -> torch.Tensor:
        """All sums in one float64 tensor, for one collective; `from_flat` reads it back."""
        return torch.cat([self.tokens[None], self.mismatch_kl[None], self.staleness_kl[None], self.worker_tokens,
                          self.worker_mismatch_kl])

    @classmethod
    def from_flat(cls, flat: torch.Tensor) -> MismatchSums:
        workers = (len(flat) - 3) // 2
        return cls(flat[0], flat[1], flat[2], flat[3:3 + workers], flat[3 + workers:])

    def add(self, other: MismatchSums) -> None:
        for name in ("tokens", "mismatch_kl", "staleness_kl", "worker_tokens", "worker_mismatch_kl"):
            getattr(self, name).add_(getattr(other, name))


def mismatch_sums(current: torch.Tensor, previous: torch.Tensor | None, inference: torch.Tensor,
                  lag: torch.Tensor, mask: torch.Tensor, worker: torch.Tensor, workers: int) -> MismatchSums:
    """The sums of one micro-batch. [samples, columns]: `current`, the trainer's logprobs at
    version n - 1; `previous`, at version n - 2 where it was scored (None: not); `inference`,
    the workers'; `lag`, n - 1 minus each token's version; `mask`, 1 on the tokens the loss
    sees. `worker`: [samples], each sample's worker index among `workers`."""
    current = current.detach().double()
    inference = inference.double()
    measured = mask.bool() & (lag == 0)
    sampled_version = current
    if previous is not None:
        measured |= mask.bool() & (lag == 1)
        sampled_version = torch.where(lag == 1, previous.detach().double(), current)
    zero = torch.zeros_like(current)
    # Select, never multiply: an unmeasured token's logprobs may be anything.
    mismatch = torch.where(measured, k3(sampled_version - inference), zero)
    staleness = torch.where(measured, k3(current - sampled_version), zero)
    count = measured.double()
    by_worker = lambda per_token: torch.zeros(workers, dtype=torch.float64, device=current.device).index_add_(  # noqa: E731
        0, worker, per_token.sum(-1))
    return MismatchSums(tokens=count.sum(), mismatch_kl=mismatch.sum(), staleness_kl=staleness.sum(),
                        worker_tokens=by_worker(count), worker_mismatch_kl=by_worker(mismatch))


def outliers(by_worker: dict[str, float]) -> list[str]:
    """The workers whose mismatch stands out from the others' (OUTLIER_KL, OUTLIER_FACTOR)."""
    out = []
    for worker, value in by_worker.items():
        others = sorted(v for w, v in by_worker.items() if w != worker)
        if others and value > OUTLIER_KL and value > OUTLIER_FACTOR * others[len(others) // 2]:
            out.append(worker)
    return out
