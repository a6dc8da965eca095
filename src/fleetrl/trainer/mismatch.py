"""How far the sampler is from the trainer, apart from how far the policy moved: each step's
`mismatch_kl` and `staleness_kl`, k3 estimates over the trained tokens, each token scored under
its own version (the training forward, or for tokens one version behind the weights kept from
before the last update). How and why: docs/design/trainer.md, "Mismatch and staleness"; what
the figures tell: docs/quickstart.md, section 3."""

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
