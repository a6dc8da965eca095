"""Step lines (records.StepLine) for unit tests: one whole, plausible line, and a way to change
what a test is about."""


from fleetrl.records import EnvFigures, StepLine, StepWorker

LINE = StepLine(
    step=1, reward_mean=0.25, reward_std=0.1, distance_max=1, distance_mean=0.5, dropped=0, sampled_prompts=2,
    filtered=0, generated_reward_mean=0.25, generated_completion_tokens_mean=12.0, trained_reward_mean=0.25,
    trained_completion_tokens_mean=12.0, dropped_by={},
    envs={"reverse": EnvFigures(groups=2, samples=8, reward_mean=0.25, completion_tokens_mean=12.0, trained_samples=8)},
    eval=None, misversioned=0, reward_failed=0, empty=0, skipped=False, samples=8, completion_tokens=96, tokens=300,
    loss=None, grad_norm=1.5, sampler_kl=0.01, mismatch_kl=1e-10, staleness_kl=0.01, ratio_mean=1.0, clip_frac=0.0,
    truncated_frac=0.0, masked_frac=0.0, entropy=2.0, ref_kl=0.0, mismatch_tokens=96, mismatch_outliers=[],
    lr=2e-5, tokens_per_s=100.0, publish_s=1.5, checksum="abc", worker_versions={"w0": 1},
    workers={"w0": StepWorker(version=1, completions=8, completion_tokens=96, tokens_per_s=12.0, mismatch_kl=1e-10,
                              publish_s=0.5)},
    failed_workers={}, probe_max_abs_diff={"w0": 0.0}, rollout_started=1e9, rollout_finished=1e9 + 5,
    train_started=1e9 + 5, train_finished=1e9 + 9)


def step_line(step: int, **changes) -> StepLine:
    """LINE at `step`, its workers at that version unless `changes` says otherwise."""
    versions = changes.pop("worker_versions", {"w0": step})
    workers = {w: StepWorker(version=v) for w, v in versions.items()}
    return LINE.model_copy(update=dict(step=step, worker_versions=versions, workers=changes.pop("workers", workers),
                                      **changes))


def step_dict(step: int, **changes) -> dict:
    """step_line's, as metrics.jsonl has it."""
    return step_line(step, **changes).to_dict()
