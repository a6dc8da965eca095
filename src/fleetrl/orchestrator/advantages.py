"""GRPO advantages: each sample's reward relative to the other samples of its prompt."""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    """(r - mean) / std within one group. A group whose samples all scored alike teaches
    nothing: its advantages are all 0 (and the std division is skipped)."""
    mean = sum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / len(centered))
    if std < eps:
        return [0.0] * len(rewards)
    return [c / std for c in centered]
