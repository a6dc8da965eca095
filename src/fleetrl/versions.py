"""The core vocabulary of policy versions (a leaf: imports nothing of fleetrl).

`v0` is the base model; trainer step `n` consumes batch `n` and produces version `n`. A
completion carries version spans: which version produced which of its tokens. The
off-policy distance of a sample trained at step `n` is `(n - 1) - min(span versions)`.
"""

from __future__ import annotations

import secrets
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
    """How fleetrl shows policy `version` to people (`v3`)."""
    return f"v{version}"


@dataclass(frozen=True)
class Label:
    """What a worker's weight label says: policy `version` of the run `run` (`v3@<run id>`).

    The run's identity is in the label because a worker may be reached by two coordinators (two
    runs attached to the same URLs): a bare `v3` would let one run train on the other's v3."""

    version: int
    run: str


def new_run_id() -> str:
    """A new run's identity in its workers' labels and claims: 16 random hex digits, so no two
    runs share one, whatever their hosts and run directories say (two containers with one
    hostname and the default runs/default once did). The run directory keeps it for every later
    start of the run (`RunDir.run_id`)."""
    return secrets.token_hex(8)


def version_label(version: int, run: str) -> str:
    """The label a worker carries for policy `version` of run `run` (vLLM's and Dynamo's weight
    version, and every token's span)."""
    return f"{version_name(version)}@{run}"


def incomplete_label(version: int, run: str) -> str:
    """The label of a worker whose transfer of `version` failed: it names no policy version."""
    return f"incomplete-{version_label(version, run)}"


def is_run_id(run: str) -> bool:
    """What a label's or a claim's run may be: ASCII letters and digits, up to 64 (`new_run_id`'s
    hex digits, and the 12 of runs from before run ids were drawn)."""
    return 0 < len(run) <= 64 and run.isascii() and run.isalnum()


def parse_label(label: str) -> Label | None:
    """`v3@a1b2` -> Label(3, "a1b2"); anything else (vLLM's initial "default", a label of
    another program, an incomplete transfer's) -> None. ASCII digits only: str.isdigit() also
    takes "²" (which int() refuses) and "١٢" (which it reads)."""
    name, _, run = label.partition("@")
    digits = name[1:]
    if name.startswith("v") and digits.isascii() and digits.isdigit() and is_run_id(run):
        return Label(int(digits), run)
    return None
