"""A training batch: what the orchestrator hands to the trainer for one step.

Batch `n` is consumed by trainer step `n`, which produces policy version `n`. Each sample
carries the version spans of its completion, so the trainer (and `fleetrl verify`) can
recompute every sample's off-policy distance, `(n - 1) - min(span versions)`, from the data
itself instead of trusting the orchestrator's bookkeeping.

Batches are files in the run directory (`RunDir.write_batch`), written whole or not at all,
so a reader never sees half a batch and a multi-node trainer only needs shared storage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from fleetrl.versions import VersionSpan, off_policy_distance


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    inference_logprobs: list[float]  # one per completion token, from the worker that sampled it
    spans: list[VersionSpan]
    reward: float
    advantage: float
    group: int  # samples of one prompt share a group (GRPO normalizes advantages within it)

    def __post_init__(self) -> None:
        if len(self.inference_logprobs) != len(self.completion_ids):
            raise ValueError(f"sample of group {self.group}: {len(self.inference_logprobs)} logprobs "
                             f"for {len(self.completion_ids)} completion tokens")


@dataclass
class Batch:
    step: int
    samples: list[Sample]
    dropped: int = 0  # samples discarded for exceeding max_off_policy_steps
    meta: dict = field(default_factory=dict)

    def distances(self) -> list[int]:
        return [off_policy_distance(self.step, s.spans) for s in self.samples]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Batch:
        data = json.loads(text)
        samples = [Sample(**{**s, "spans": [VersionSpan(**sp) for sp in s["spans"]]}) for s in data["samples"]]
        return cls(step=data["step"], samples=samples, dropped=data["dropped"], meta=data["meta"])
