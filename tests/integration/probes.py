"""The tests' own agreement probe: do the workers really hold the weights a test gave them?

A fixed probe batch of texts is scored on every worker (prompt logprobs, which do not depend on
sampling) and by transformers from the test's own model; the per-worker mean/max absolute
difference exposes a worker whose weights never synced, which a version label alone would not.
fp32 serving agrees with transformers fp32 to about 1e-4. (fleetrl's own probe, after every
publish, is `inference.fleet.AgreementProbe`: token ids the trainer scores.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from fleetrl.inference.fleet import Fleet
from fleetrl.trainer.model import prompt_logprobs

PROBE_TEXTS = [
    "The capital of France is Paris. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Reinforcement learning trains a policy to maximize the expected reward of",
]


@dataclass
class ProbeResult:
    worker_id: str
    mean_abs_diff: float
    max_abs_diff: float


async def probe_fleet(fleet: Fleet, model: torch.nn.Module, probe: list[list[int]]) -> list[ProbeResult]:
    """Score `probe` (token id sequences) on every routable worker and against `model`
    (through a ready prefill worker where the fleet has them; those are also checked by
    checksum at every publish)."""
    reference = [await asyncio.to_thread(prompt_logprobs, model, ids, torch.device("cpu")) for ids in probe]
    results = []
    prefill = next(iter(fleet.ready_prefill_workers()), None)
    for worker in fleet.routable_workers():
        diffs: list[float] = []
        for ids, ref in zip(probe, reference):
            served = await fleet.provider.prompt_logprobs(worker, ids, prefill)
            diffs += [abs(a - b) for a, b in zip(served, ref)]
        results.append(ProbeResult(worker.id, sum(diffs) / len(diffs), max(diffs)))
    return results
