"""The learning rate of each trainer step: linear warmup, then constant, linear or cosine decay.

The rate is a function of the step number and the config alone, with no state of its own: a
resumed run computes step n's rate exactly as the run that was not stopped would have (the
optimizer's checkpointed `lr` is overwritten before every step). Step n is the optimizer step
that makes version n, counted from 1.

- Warmup: steps 1..W climb linearly to `lr` (step W is the first at the full rate), since the
  first batches' advantages are the noisiest and Adam's moment estimates are not settled yet.
- Decay: over the D steps after warmup, from `lr` at step W + 1 toward `lr_min`, which is the
  rate from step W + D + 1 on: each step's rate is the schedule's value as the step begins, so
  the last step of the run still learns (reaching `lr_min = 0` at it would waste it).
  D is `lr_decay_steps`, or 0 for "until run.max_steps" (a resume that raises max_steps then
  stretches the rest of the decay: set `lr_decay_steps` to keep the horizon fixed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Decay = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class Schedule:
    lr: float = 1e-6  # the peak rate
    warmup_steps: int = 0
    decay: Decay = "constant"
    decay_steps: int = 0  # 0: until `max_steps`
    lr_min: float = 0.0
    max_steps: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.lr_min <= self.lr:
            raise ValueError(f"lr_min must be in [0, lr = {self.lr:g}], got {self.lr_min:g}")
        if self.decay != "constant" and self.horizon() < 1:
            raise ValueError(f"{self.decay} decay has no step to decay over: lr_warmup_steps = {self.warmup_steps} "
                             f"leaves none of run.max_steps = {self.max_steps} (or set lr_decay_steps)")

    def horizon(self) -> int:
        """The steps the decay runs over."""
        return self.decay_steps or self.max_steps - self.warmup_steps

    def rate(self, step: int) -> float:
        """The learning rate of step `step` (1-based)."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        progress = min(1.0, (step - 1 - self.warmup_steps) / self.horizon())
        shape = 1 - progress if self.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr_min + (self.lr - self.lr_min) * shape
