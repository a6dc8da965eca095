"""What the run directory's record files hold: one typed record per kind of line, written and
read through these types only, and read strictly (a key missing or unknown, or a value of
another type, is an error that names the file and the record, not a KeyError or a TypeError
three modules later).

    metrics.jsonl            StepLine       one per trained step: written by app/rl.py through
                                            monitoring.StepSink, read by status, plots, verify; it
                                            holds the producers' own records: the batch's
                                            BatchMeta, the trainer's StepMetrics, the fleet's
                                            PublishReport
                             FlatStepLine   the flat form written before December 2026: read,
                                            never written (`read_step_line`)
                             SftLine        a `fleetrl sft` run's instead (app/sft.py)
    batches/step_N.json      BatchMeta      Batch.meta: how the orchestrator made batch N, and how
                                            what it trains differs from what it generated
    rollouts/step_N.jsonl    RolloutRecord  every sample generated for batch N, trained or not
    eval.jsonl               EvalLine       one per evaluation (orchestrator/evaluation.py): an
                                            EvalFigures per environment, as a step line's `eval`
                                            has them; its samples are RolloutRecords, in
                                            eval/step_N.jsonl
    final.json               FinalRecord    how the run left its fleet: a greedy sample of the
                                            final policy, each worker, the agreement probe
    events.jsonl             WorkerEvent, FenceEvent, SampleEvent, TrainEvent: the timeline

Each type is a strict pydantic model (`Record`, fleetrl/strict.py): its JSON is its fields by
name (`to_dict`), and `read(data, where)` is the one way back. Nested figures are records too
(`Figures`, `EnvFigures`, `WorkerFigures`, `EvalFigures`).
"""

from __future__ import annotations

import time
import typing
from typing import Any, ClassVar

from pydantic import Field, model_serializer, model_validator

from fleetrl.strict import RecordError, Strict


class Record(Strict):
    """A record of the run directory's files."""


# -- figures nested in the records -----------------------------------------------------------

class Figures(Record):
    """Samples, their mean reward (of those scored) and mean completion length: of what was
    generated for a batch, or of what it trains on."""

    samples: int
    reward_mean: float | None
    completion_tokens_mean: float | None


class EnvFigures(Figures):
    """One environment's part of a batch (orchestrator.envs): the figures of what it generated,
    its groups, and how many of its samples were trained."""

    groups: int
    trained_samples: int


class WorkerFigures(Record):
    """What one worker served for a batch."""

    completions: int
    completion_tokens: int
    tokens_per_s: float  # of the batch's sampling time


# -- the records -----------------------------------------------------------------------------

class RolloutRecord(Record):
    """One sample generated for a batch: what it was, how it scored, where its tokens came from
    (spans: [version, start] pairs), and whether it was trained or why not (drop_reason)."""

    step: int
    group: int
    task: str
    env: str
    completion: str
    reward: float | None
    advantage: float | None
    worker: str | None
    completion_tokens: int
    prefill_worker: str | None
    spans: list[list[int]]
    distance: int | None
    trained: bool
    drop_reason: str | None
    reward_error: str | None
    version_error: str | None
    answer_error: str | None = None  # why its worker's answer failed a check (drop_reason bad_answer)
    # Multi-turn episodes only: where each model turn lies, how the episode ended and why, and the
    # conversation after the task's messages.
    turns: list[list[int]] | None = None
    end: str | None = None
    episode_error: str | None = None
    messages: list[dict] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A single completion's line has no episode keys."""
        episode = {"turns", "end", "episode_error", "messages"}
        return self.model_dump(mode="json", exclude=episode if self.turns is None else None)


class BatchMeta(Record):
    """How batch `step` was made; the figures of what it trains are those of its records."""

    # Written until December 2026, never read: the admission wait's start, k (config.toml has it),
    # and five drop counts dropped_by holds.
    RETIRED: ClassVar = ("waited_from", "max_off_policy_steps", "tool_failed", "env_failed", "misversioned",
                         "reward_failed", "empty")

    sampled_prompts: int  # groups sampled (more than batch_prompts under dynamic sampling)
    filtered: int  # groups dynamic sampling dropped
    generated: Figures
    trained: Figures
    dropped_by: dict[str, int]  # samples not trained, by drop_reason
    envs: dict[str, EnvFigures]
    workers: dict[str, WorkerFigures]
    rollout_started: float  # wall time: sampling began (after the k bound admitted it) and ended
    rollout_finished: float
    dispatch_version: int  # the fleet's version as sampling began
    reward_mean: float  # over every scored sample generated
    reward_std: float
    distance_max: int  # over the trained samples
    distance_mean: float

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data: Any) -> Any:
        """An older fleetrl's batch still reads: its runs resume and verify."""
        return {k: v for k, v in data.items() if k not in cls.RETIRED} if isinstance(data, dict) else data


class StepMetrics(Record):
    """What one trainer step measured (trainer/step.py). KL and loss figures are None where they
    were not finite or measured no token: JSON has no NaN."""

    skipped: bool  # the loss or the gradient norm was not finite: the update was not applied
    loss: float | None
    grad_norm: float | None  # before clipping
    lr: float  # the rate this step's update was made with (the schedule's)
    sampler_kl: float | None  # mean k3 KL(inference || trainer now) over completion tokens: what the ratio corrects
    mismatch_kl: float | None  # mean k3 KL(worker at v || trainer at v), v each token's version (trainer/mismatch.py)
    staleness_kl: float | None  # mean k3 KL(trainer at v || trainer now), over the same tokens
    mismatch_tokens: int  # the tokens those two are measured on
    worker_mismatch_kl: dict[str, float | None]  # mismatch_kl of each worker's tokens
    mismatch_outliers: list[str]  # the workers whose mismatch_kl stands out (trainer/mismatch.py)
    ratio_mean: float | None
    clip_frac: float | None  # tokens whose gradient the PPO clip removed
    truncated_frac: float | None  # tokens whose weight the TIS cap lowered
    masked_frac: float | None  # tokens masked importance sampling dropped (trainer.mis_*)
    entropy: float | None  # mean entropy of the policy being trained, over completion tokens
    ref_kl: float | None  # mean k3 KL(trainer || reference model) (trainer.loss.kl_coef; 0 when off)
    # The batch's largest and mean off-policy distance, recomputed here from its spans: what
    # `fleetrl verify` checks, not the orchestrator's bookkeeping.
    max_off_policy: int
    mean_off_policy: float
    samples: int
    completion_tokens: int  # the tokens the loss saw (of a multi-turn episode: the model's turns)
    tokens: int  # prompt + completion tokens of the batch's samples (the forward takes a group's prompt once)
    tokens_per_s: float


def _unset(value: Any) -> bool:
    return value is None


class WaveReport(Record):
    """One wave of a rolling publish (inference/fleet/fence.py): the workers it fenced at
    `version`, which came out ready and which failed, when it began (wall time) and its seconds.
    `canary`: no worker had agreed at `version` before it, so the version went no further until
    one of it did."""

    version: int
    wave: int  # 1, 2, ... within the publish of `version`
    canary: bool
    workers: list[str]
    ready: list[str]
    failed: dict[str, str]
    started: float
    seconds: float


class PublishReport(Record):
    """How one version's publish went (inference/fleet.py): which workers came out ready at
    `version`, which failed and why, and each ready one's time, bytes and probe."""

    version: int
    seconds: float
    checksum: str
    ready: list[str]  # workers verified at `version` and resumed
    failed: dict[str, str] = Field(default_factory=dict)  # worker id -> why it is dead or stale
    # ready worker id -> seconds from the fence's start until it was verified (and passed the probe)
    worker_seconds: dict[str, float] = Field(default_factory=dict)
    probe: dict[str, float] = Field(default_factory=dict)  # worker id -> max |delta logprob| on the probe
    # ready worker id -> the tensor bytes its ranks received (the most of any rank): what the
    # publish moved onto it, a LoRA run's adapter alone or the whole model
    received_bytes: dict[str, int] = Field(default_factory=dict)
    # A rolling publish's waves that ended since the last publish returned, its own first ones
    # (until the canary agreed) and the rest of the one before (which went on after it returned);
    # None in a fenced publish. `ready` and the figures above are those of the waves of `version`.
    waves: list[WaveReport] | None = Field(None, exclude_if=_unset)


class StepLine(Record):
    """One trained step, as metrics.jsonl, TensorBoard, W&B, the live view and the printed line
    have it (monitoring.StepSink): each part is the record of the part of the run that made it."""

    step: int
    batch: BatchMeta  # the orchestrator's (orchestrator/rollouts.py), as batches/step_N.json has it
    update: StepMetrics  # the trainer's (trainer/step.py)
    publish: PublishReport  # the fleet's, of this step's version (inference/fleet.py)
    eval: dict[str, EvalFigures] | None  # per evaluated environment, at an evaluated step
    worker_versions: dict[str, int]  # each ready worker's version once the publish was done
    train_started: float  # wall times of the trainer's step
    train_finished: float


class SftMetrics(Record):
    """What one step of `fleetrl sft` measured (trainer/sft.py); loss and grad_norm are None
    where they were not finite."""

    step: int
    skipped: bool  # the loss or the gradient norm was not finite: the update was not applied
    loss: float | None  # mean NLL per assistant token
    grad_norm: float | None  # before clipping
    lr: float
    sequences: int
    loss_tokens: int  # the assistant tokens the loss saw
    tokens: int  # every token of the step's sequences
    micro_batches: int  # the forwards of each rank
    tokens_per_s: float


class SftLine(SftMetrics):
    """One step of `fleetrl sft`, in its metrics.jsonl and wherever StepSink shows it: what the
    step measured, at the top of the line as before, and its wall times."""

    train_started: float
    train_finished: float


PASS_AT = "pass@"  # JSON's key of pass@k: pass@1, pass@4


class EvalFigures(Record):
    """One environment's figures of an evaluation (orchestrator/evaluation.py): its prompts, their
    completions and how many of those failed, the mean reward of those scored and its standard
    error over the prompts, and pass@k for k = 1 and eval.samples_per_prompt (when more). JSON
    has each pass@k as a key of its own ("pass@1", "pass@4"), as a line has always had them."""

    prompts: int
    samples: int  # completions
    failed: int  # completions not scored (a drop_reason)
    reward_mean: float | None  # None: none scored
    reward_se: float | None = None  # None: fewer than two prompts scored, or a line before December 5 2026
    pass_at: dict[int, float | None]  # k -> pass@k; None: no prompt had k completions scored

    @model_validator(mode="before")
    @classmethod
    def _read_pass_keys(cls, data: Any) -> Any:
        """JSON's pass@k keys, into pass_at."""
        pass_keys = {key for key in data if isinstance(key, str) and key.startswith(PASS_AT)
                     and key.removeprefix(PASS_AT).isdigit()} if isinstance(data, dict) else None
        if not pass_keys or "pass_at" in data:
            return data  # pass_at as it is, missing, or beside pass@k keys: a RecordError
        return {**{k: v for k, v in data.items() if k not in pass_keys},
                "pass_at": {int(key.removeprefix(PASS_AT)): data[key] for key in sorted(pass_keys)}}

    @model_serializer(mode="wrap")
    def _write_pass_keys(self, write) -> dict[str, Any]:
        data = write(self)
        return {**{k: v for k, v in data.items() if k != "pass_at"},
                **{f"{PASS_AT}{k}": value for k, value in data["pass_at"].items()}}


class EvalLine(Record):
    """One evaluation of `version`: when it began, how long it took, and each environment's
    figures."""

    version: int
    started: float
    seconds: float
    envs: dict[str, EvalFigures]


class FinalWorker(Record):
    """One worker as the run left it: its role, the version it served, and the checksum of the
    weights every one of its ranks holds (None: the base model's, none received)."""

    role: str
    version: int | None
    checksum: str | None


class FinalProbe(Record):
    """The agreement probe of the final version: its tokens and the trainer's logprobs of them,
    which the final model, served anywhere, scores alike."""

    token_ids: list[int]
    trainer_logprobs: list[float]


class FinalRecord(Record):
    """final.json: how the run left its fleet (app/rl.py): its version, a 16-token greedy sample
    of the final policy with its spans ([version, start] pairs), each worker, and the probe."""

    version: int
    tokens: list[int]
    text: str
    spans: list[list[int]]
    workers: dict[str, FinalWorker]
    probe: FinalProbe | None = None  # none in a run before December 2 2026


# -- the flat form of metrics.jsonl, before December 2026 --------------------------------------

class StepWorker(Record):
    """One worker in a flat step line: its version after the publish, what it served for the batch
    (None: nothing), its mismatch_kl, its time in the publish and the tensor bytes the publish
    moved onto it (None: not measured; a LoRA run's publish moves its adapter alone)."""

    version: int | None
    completions: int | None = None
    completion_tokens: int | None = None
    tokens_per_s: float | None = None
    mismatch_kl: float | None = None
    publish_s: float | None = None
    publish_bytes: int | None = None


class FlatStepLine(Record):
    """A metrics.jsonl line as fleetrl wrote it before December 2026, every figure at the top:
    read (`read_step_line`), never written, so that older runs still verify, resume, show and
    plot. What both forms are read for goes through `trained_distance` and `reward_mean`."""

    step: int
    # The batch (orchestrator/rollouts.py): rewards, off-policy distances (recomputed by the
    # trainer from the spans), what was dropped and why, per environment.
    reward_mean: float
    reward_std: float
    distance_max: int
    distance_mean: float
    dropped: int  # off_policy drops
    sampled_prompts: int
    filtered: int
    generated_reward_mean: float | None
    generated_completion_tokens_mean: float | None
    trained_reward_mean: float | None
    trained_completion_tokens_mean: float | None
    dropped_by: dict[str, int]
    envs: dict[str, EnvFigures]
    eval: dict[str, EvalFigures] | None  # per evaluated environment, at an evaluated step
    misversioned: int
    reward_failed: int
    empty: int
    # The update (trainer/step.py).
    skipped: bool
    samples: int
    completion_tokens: int
    tokens: int
    loss: float | None
    grad_norm: float | None
    sampler_kl: float | None
    mismatch_kl: float | None
    staleness_kl: float | None
    ratio_mean: float | None
    clip_frac: float | None
    truncated_frac: float | None
    masked_frac: float | None
    entropy: float | None
    ref_kl: float | None
    mismatch_tokens: int
    mismatch_outliers: list[str]
    lr: float
    tokens_per_s: float
    # The publish of this step's version (inference/fleet/fence.py).
    publish_s: float
    checksum: str
    worker_versions: dict[str, int]
    workers: dict[str, StepWorker]
    failed_workers: dict[str, str]
    probe_max_abs_diff: dict[str, float]
    # Wall times.
    rollout_started: float
    rollout_finished: float
    train_started: float
    train_finished: float


def read_step_line(data: Any, where: str) -> StepLine | FlatStepLine:
    """An rl run's metrics.jsonl line: a StepLine, or the flat form an older fleetrl wrote (it has
    no `update`)."""
    flat = isinstance(data, dict) and "update" not in data and "reward_mean" in data
    return (FlatStepLine if flat else StepLine).read(data, where)


def trained_distance(line: StepLine | FlatStepLine) -> tuple[int, float]:
    """The largest and the mean off-policy distance step `line.step` trained at, as the trainer
    read them from the spans."""
    if isinstance(line, FlatStepLine):
        return line.distance_max, line.distance_mean
    return line.update.max_off_policy, line.update.mean_off_policy


def reward_mean(line: StepLine | FlatStepLine) -> float:
    """The mean reward of every scored sample generated for step `line.step`."""
    return line.reward_mean if isinstance(line, FlatStepLine) else line.batch.reward_mean


# -- the timeline (events.jsonl) --------------------------------------------------------------

class WorkerEvent(Record):
    """A worker changed state (inference/fleet/roster.py)."""

    KIND: ClassVar = "worker"
    worker: str
    role: str
    state: str
    version: int | None
    error: str | None
    t: float = Field(default_factory=time.time)


class FenceEvent(Record):
    """A publish's fence began (`start`) or ended (`end`, with the workers that came out ready);
    in a rolling publish, one wave's fence, `wave` its number (None in a fenced publish), `canary`
    whether it was the canary, `workers` those it fenced."""

    KIND: ClassVar = "fence"
    phase: str
    version: int
    ready: list[str] | None = None
    wave: int | None = Field(None, exclude_if=_unset)
    canary: bool | None = Field(None, exclude_if=_unset)
    workers: list[str] | None = Field(None, exclude_if=_unset)
    t: float = Field(default_factory=time.time)


class SampleEvent(Record):
    """One sample's time on its worker, split at its spans (orchestrator/rollouts.py)."""

    KIND: ClassVar = "sample"
    step: int
    group: int
    sample: int
    worker: str | None
    start: float
    end: float
    tokens: int
    spans: list[list[int]]
    t: float = Field(default_factory=time.time)


class TrainEvent(Record):
    """One trainer step's time."""

    KIND: ClassVar = "train"
    step: int
    start: float
    end: float
    t: float = Field(default_factory=time.time)


FleetEvent = WorkerEvent | FenceEvent | SampleEvent | TrainEvent
EVENTS: dict[str, type] = {cls.KIND: cls for cls in typing.get_args(FleetEvent)}


def event_to_dict(event: FleetEvent) -> dict[str, Any]:
    return {"event": event.KIND, **event.to_dict()}


def read_event(data: Any, where: str) -> FleetEvent:
    kind = data.get("event") if isinstance(data, dict) else None
    if kind not in EVENTS:
        raise RecordError(f"{where}: not an event of the timeline (event: {kind!r}, not one of {sorted(EVENTS)})")
    return EVENTS[kind].read({k: v for k, v in data.items() if k != "event"}, where)
