"""A training batch: what the orchestrator hands to the trainer for one step.

Batch `n` is consumed by trainer step `n`, which produces policy version `n`. Each sample
carries the version spans of its completion, so the trainer (and `fleetrl verify`) can
recompute every sample's off-policy distance, `(n - 1) - min(span versions)`, from the data
itself instead of trusting the orchestrator's bookkeeping.

A multi-turn episode is one sample: its completion holds every model turn and, between them,
the environment's tokens (user turns, tool results). `loss_mask` says which tokens the loss
sees (the model's, not the environment's), `turns` where each model turn lies, and every model
turn opens a span of its own. The distance is taken over the tokens the loss sees.

Batches are files in the run directory (`RunDir.write_batch`), written whole or not at all,
so a reader never sees half a batch and a multi-node trainer only needs shared storage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fleetrl.records import BatchMeta
from fleetrl.versions import VersionSpan, off_policy_distance, trained_spans


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    inference_logprobs: list[float]  # one per completion token, from the worker that sampled it
    spans: list[VersionSpan]
    reward: float
    advantage: float
    group: int  # samples of one prompt share a group (GRPO normalizes advantages within it)
    # Multi-turn episodes only (None: a single completion, every token the model's, trained):
    loss_mask: list[int] | None = None  # 1 on the completion tokens the loss sees, 0 elsewhere
    turns: list[list[int]] | None = None  # [start, end) of each model turn in the completion
    worker: str | None = None  # the worker that sampled it (an episode's, joined by +): per-worker figures
    env: str | None = None  # the name of the environment its group's task came from (envs/mix.py)

    def __post_init__(self) -> None:
        where = f"sample of group {self.group}"
        if len(self.inference_logprobs) != len(self.completion_ids):
            raise ValueError(f"{where}: {len(self.inference_logprobs)} logprobs "
                             f"for {len(self.completion_ids)} completion tokens")
        if self.loss_mask is not None and len(self.loss_mask) != len(self.completion_ids):
            raise ValueError(f"{where}: a loss mask of {len(self.loss_mask)} for {len(self.completion_ids)} tokens")

    def trained_tokens(self) -> int:
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)

    def trained_spans(self) -> list[VersionSpan]:
        """The spans holding at least one token the loss sees: what the distance is taken over."""
        return trained_spans(self.spans, self.loss_mask)


@dataclass
class Batch:
    step: int
    samples: list[Sample]
    meta: BatchMeta | None = None  # the orchestrator's (None: a batch made by hand, in tests)

    def distances(self) -> list[int]:
        return [off_policy_distance(self.step, s.trained_spans()) for s in self.samples]

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "meta": self.meta.to_dict() if self.meta is not None else None})

    @classmethod
    def from_json(cls, text: str, where: str = "batch") -> Batch:
        """`where`: the file, for an error about its meta."""
        data = json.loads(text)
        samples = [Sample(**{**s, "spans": [VersionSpan(**sp) for sp in s["spans"]]}) for s in data["samples"]]
        meta = BatchMeta.read(data["meta"], f"{where}: meta") if data["meta"] is not None else None
        # A batch written until December 2026 also has "dropped", which meta.dropped_by holds.
        return cls(step=data["step"], samples=samples, meta=meta)
