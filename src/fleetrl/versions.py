"""The core vocabulary of policy versions (a leaf: imports nothing of fleetrl).

`v0` is the base model; trainer step `n` consumes batch `n` and produces version `n`. A
completion carries version spans: which version produced which of its tokens. The
off-policy distance of a sample trained at step `n` is `(n - 1) - min(span versions)`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VersionSpan:
    """Tokens from `start` up to the next span's start were produced by policy `version`."""

    version: int
    start: int


def off_policy_distance(step: int, spans: list[VersionSpan]) -> int:
    """How many versions behind the policy being trained (`step - 1`) a sample's oldest token is."""
    return (step - 1) - min(span.version for span in spans)


def trained_spans(spans: list[VersionSpan], loss_mask: list[int] | None) -> list[VersionSpan]:
    """The spans holding at least one token the loss sees (`loss_mask` 1): the ones a sample's
    distance is taken over, when part of it is not trained (an environment's tokens). No mask:
    every token is trained, and every span counts."""
    if loss_mask is None:
        return spans
    return [span for span, end in span_ends(spans, len(loss_mask)) if any(loss_mask[span.start:end])]


def span_ends(spans: list[VersionSpan], length: int) -> list[tuple[VersionSpan, int]]:
    """Each span with the end of its tokens, in a completion of `length` tokens."""
    return list(zip(spans, [s.start for s in spans[1:]] + [length]))


def version_name(version: int) -> str:
    """The label a worker carries for policy `version` (vLLM's and Dynamo's weight version)."""
    return f"v{version}"


def incomplete_version_name(version: int) -> str:
    """The label of a worker whose transfer of `version` failed: it names no policy version."""
    return f"incomplete-{version_name(version)}"


def parse_version(name: str) -> int | None:
    """`v3` -> 3; anything else (vLLM's initial "default", a foreign label) -> None. ASCII
    digits only: str.isdigit() also takes "²" (which int() refuses) and "١٢" (which it reads)."""
    if name.startswith("v") and name[1:].isascii() and name[1:].isdigit():
        return int(name[1:])
    return None
