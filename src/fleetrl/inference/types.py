"""Provider-neutral types of the inference layer: what the orchestrator sends and gets back,
and what the fleet coordinator knows about each worker."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field

from fleetrl.errors import FleetrlError
from fleetrl.versions import VersionSpan, parse_label


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # keep sampling past the end-of-sequence token (benchmarks, tests)
    logprobs: bool = True  # the sampled token's logprob, per completion token


@dataclass(frozen=True)
class GenerateRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    n: int = 1  # samples of this prompt (a GRPO group)
    session_id: str | None = None  # requests with one session id go to one worker while it lives
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The oldest version whose tokens the caller can use (a single-turn group of step s: (s - 1) - k):
    # no worker holding an older one is sent it, mid-rolling-publish included. An episode's turns
    # carry none: a partial episode keeps older turns as context, and the episode stops itself.
    min_version: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise FleetrlError(f"request {self.request_id}: prompt_token_ids is empty")
        if self.n < 1:
            raise FleetrlError(f"request {self.request_id}: n must be >= 1, got {self.n}")


@dataclass
class GenerateResponse:
    """One completion (one sample of a request)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    worker_id: str
    spans: list[VersionSpan]
    # Set by the fleet when the spans lie outside the versions it published (a worker that
    # changed weights behind its back): the orchestrator rejects and counts such a sample.
    version_error: str | None = None
    # Set when the worker's answer failed a check of this sample (inference/answers.py): it then
    # carries no tokens, and the orchestrator drops it (`bad_answer`).
    answer_error: str | None = None
    # Disaggregated serving: the worker that computed the prompt's KV, when not `worker_id`.
    prefill_worker_id: str | None = None

    def check(self) -> None:
        """Spans must start at 0, increase strictly and lie inside the completion."""
        starts = [s.start for s in self.spans]
        if not self.spans or starts[0] != 0 or starts != sorted(set(starts)):
            raise FleetrlError(f"request {self.request_id}: malformed version spans {self.spans}")
        if self.token_ids and starts[-1] >= len(self.token_ids):
            raise FleetrlError(f"request {self.request_id}: span starts past the completion {self.spans}")


class UnversionedTokens(FleetrlError):
    """A worker produced tokens under a weight label that names no version of this run:
    "default" is a vLLM server started again at the same address with its base weights, before
    the fleet noticed; `v3@<other id>` is another run's v3 (two coordinators on one worker). The
    worker needs a refit; the request is sent again (`Routing._generate_once`)."""

    def __init__(self, worker_id: str, request_id: str, label: object, run: str) -> None:
        parsed = parse_label(str(label))
        why = (f"run {parsed.run}'s, not this run's ({run}): another fleetrl run changed its weights"
               if parsed is not None else "not a fleetrl policy version (restarted?)")
        super().__init__(f"worker {worker_id}: request {request_id} produced tokens under weight version "
                         f"{label!r}, {why}")
        self.worker_id = worker_id


def engine_spans(worker_id: str, request_id: str, items: list[dict], run: str, tokens: int) -> list[VersionSpan]:
    """Spans from vLLM's per-token record of a completion of `tokens` tokens (`[{"version":
    "v1@<run>", "start": 0, "end": 27}, {"version": "v2@<run>", "start": 27, "end": 60}]`),
    adjacent spans of one version merged. The record must label every token once, in order
    (each span ends where the next starts, the last at `tokens`), at versions that never go
    back (a worker's weights only move forward), each a version of run `run`."""
    spans: list[VersionSpan] = []
    end = 0
    for item in items:
        label = parse_label(str(item["version"]))
        if label is None or label.run != run:
            raise UnversionedTokens(worker_id, request_id, item["version"], run)
        start, stop = int(item["start"]), int(item["end"])
        if start != end or stop <= start:
            raise FleetrlError(f"request {request_id}: span {item} does not go on from token {end} (version spans "
                               f"{items})")
        if spans and label.version < spans[-1].version:
            raise FleetrlError(f"request {request_id}: version spans go back from v{spans[-1].version} to "
                               f"v{label.version} ({items})")
        if not spans or spans[-1].version != label.version:
            spans.append(VersionSpan(version=label.version, start=start))
        end = stop
    if end != tokens:
        raise FleetrlError(f"request {request_id}: version spans label {end} of {tokens} tokens ({items})")
    return spans


class WorkerRole(str, enum.Enum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class WorkerState(str, enum.Enum):
    JOINING = "joining"
    SYNCING = "syncing"
    READY = "ready"
    PAUSED = "paused"
    UPDATING = "updating"
    STALE = "stale"  # up, but not at the fleet's version: no traffic until refitted
    DEAD = "dead"


@dataclass
class WorkerInfo:
    id: str  # stable across re-discovery
    # Where requests pinned to the worker go (a native server; Dynamo: the frontend, which
    # routes them to the worker), and where its admin routes live (a native server, the same
    # URL; Dynamo: the worker's own system server). A new admin URL is a restarted worker.
    data_url: str
    admin_url: str
    role: WorkerRole = WorkerRole.AGGREGATED
    world_size: int = 1
    state: WorkerState = WorkerState.JOINING
    version: int | None = None
    error: str | None = None  # why the worker is stale or dead
