"""Step lines (records.StepLine) for unit tests: one whole, plausible line, and a way to change
what a test is about."""

from fleetrl.records import BatchMeta, EnvFigures, Figures, PublishReport, StepLine, StepMetrics, WorkerFigures

FIGURES = Figures(samples=8, reward_mean=0.25, completion_tokens_mean=12.0)
BATCH = BatchMeta(
    sampled_prompts=2, filtered=0, generated=FIGURES, trained=FIGURES, dropped_by={},
    envs={"reverse": EnvFigures(groups=2, samples=8, reward_mean=0.25, completion_tokens_mean=12.0, trained_samples=8)},
    workers={"w0": WorkerFigures(completions=8, completion_tokens=96, tokens_per_s=12.0)},
    rollout_started=1e9, rollout_finished=1e9 + 5, dispatch_version=0, reward_mean=0.25, reward_std=0.1,
    distance_max=1, distance_mean=0.5)
UPDATE = StepMetrics(
    skipped=False, loss=None, grad_norm=1.5, lr=2e-5, sampler_kl=0.01, mismatch_kl=1e-10, staleness_kl=0.01,
    mismatch_tokens=96, worker_mismatch_kl={"w0": 1e-10}, mismatch_outliers=[], ratio_mean=1.0, clip_frac=0.0,
    truncated_frac=0.0, masked_frac=0.0, entropy=2.0, ref_kl=0.0, max_off_policy=1, mean_off_policy=0.5, samples=8,
    completion_tokens=96, tokens=300, tokens_per_s=100.0)
LINE = StepLine(
    step=1, batch=BATCH, update=UPDATE,
    publish=PublishReport(version=1, seconds=1.5, checksum="abc", ready=["w0"], worker_seconds={"w0": 0.5},
                          probe={"w0": 0.0}),
    eval=None, worker_versions={"w0": 1}, train_started=1e9 + 5, train_finished=1e9 + 9)


def changed(record, **changes):
    """`record` with `changes`, each of them a figure or, for a part, a dict of its figures."""
    return record.model_copy(update={name: changed(getattr(record, name), **value) if isinstance(value, dict)
                                     and hasattr(getattr(record, name), "model_copy") else value
                                     for name, value in changes.items()})


def step_line(step: int, **changes) -> StepLine:
    """LINE at `step`, its workers at that version unless `changes` says otherwise."""
    return changed(LINE, step=step, worker_versions=changes.pop("worker_versions", {"w0": step}), **changes)


def step_dict(step: int, **changes) -> dict:
    """step_line's, as metrics.jsonl has it."""
    return step_line(step, **changes).to_dict()
