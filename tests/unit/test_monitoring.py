"""The step sink: each step's line in metrics.jsonl, TensorBoard event files, an offline W&B run
(real packages), the live view and the printed line, all from the one record."""


import psutil

from fleetrl.config import Config
from fleetrl.monitoring import StepSink, scalars, step_text
from fleetrl.records import EvalFigures, WaveReport
from fleetrl.rundir import RunDir

from .step_lines import LINE, changed

def test_scalars_are_the_numbers_of_a_line_by_their_path_in_it():
    values = scalars(LINE.to_dict())
    assert values["batch/reward_mean"] == 0.25 and values["update/clip_frac"] == 0.0 and values["update/lr"] == 2e-5
    assert "update/loss" not in values and values["update/skipped"] == 0.0 and "publish/checksum" not in values
    assert "batch/rollout_started" not in values and "publish/version" not in values
    assert {k: v for k, v in values.items() if "w0" in k} == {
        "batch/workers/w0/completions": 8.0, "batch/workers/w0/completion_tokens": 96.0,
        "batch/workers/w0/tokens_per_s": 12.0, "update/worker_mismatch_kl/w0": 1e-10,
        "publish/worker_seconds/w0": 0.5, "publish/probe/w0": 0.0, "worker_versions/w0": 1.0}
    assert values["batch/envs/reverse/trained_samples"] == 8.0


def test_the_printed_line_says_n_a_for_what_measured_nothing():
    text = step_text(changed(LINE, update={"mismatch_kl": None}), 10, dynamic_sampling=False)
    assert text.startswith("step 1/10  reward 0.250±0.100  off-policy max 1 mean 0.50")
    assert "loss n/a" in text and "mismatch n/a" in text and "staleness 1.0e-02" in text
    assert "train 4.0s  publish 1.5s  workers at [1]" in text and "filtered" not in text
    assert "  dropped none  " in text
    assert "  dropped off_policy 2, tool_failed 1  " in step_text(
        changed(LINE, batch={"dropped_by": {"off_policy": 2, "tool_failed": 1}}), 10, dynamic_sampling=False)
    assert "filtered 0/2 groups" in step_text(LINE, 10, dynamic_sampling=True)
    assert "waves" not in text  # a fenced publish has none


def test_the_printed_line_names_the_waves_of_rolling_publishes():
    waves = [WaveReport(version=1, wave=2, canary=False, workers=["w1"], ready=["w1"], failed={}, started=0.0,
                        seconds=0.4),
             WaveReport(version=2, wave=1, canary=True, workers=["w0"], ready=["w0"], failed={}, started=1.0,
                        seconds=0.5)]
    text = step_text(changed(LINE, publish={"waves": waves}), 10, dynamic_sampling=False)
    assert text.endswith("workers at [1]  waves v1/2 w1 0.4s, v2/1* w0 0.5s")


def test_one_write_reaches_metrics_tensorboard_wandb_offline_the_view_and_the_log_without_the_tokens(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = Config()
    config.run.wandb = True
    config.run.max_steps = 2
    config.inference.admin_token = "secret-admin-token-123"
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    shown, logged = [], []

    class View:
        def step_done(self, step: int, detail: str) -> None:
            shown.append((step, detail))

    sink = StepSink(config, run_dir, View(), log=logged.append)
    sink.write_eval(0, {"reverse": EvalFigures(prompts=1, samples=1, failed=0, reward_mean=0.5, pass_at={1: 0.25})})
    sink.write(LINE)
    second = changed(LINE, step=2, batch={"reward_mean": 0.75},
                     update={"mismatch_outliers": ["w1"], "worker_mismatch_kl": {"w0": 1e-10, "w1": 1e-2}})
    sink.write(second)
    sink.close()
    sink.close()  # idempotent

    assert run_dir.read_metrics() == [LINE, second]
    assert shown == [(1, "reward 0.250"), (2, "reward 0.750")]
    assert [line for line in logged if line.startswith("step ")] == [
        step_text(LINE, 2, False), step_text(second, 2, False)]
    assert any("worker w1's mismatch_kl 1.00e-02 stands out" in line for line in logged), logged
    events = EventAccumulator(str(run_dir.tensorboard_dir))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("batch/reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("eval/reverse/pass@1")] == [(0, 0.25)]
    assert [e.value for e in events.Scalars("batch/workers/w0/tokens_per_s")] == [12.0, 12.0]
    (run,) = (run_dir.wandb_dir / "wandb").glob("offline-run-*")
    assert list(run.glob("*.wandb")), list(run.iterdir())
    for path in run_dir.root.rglob("*"):
        if path.is_file():
            assert b"secret-admin-token-123" not in path.read_bytes(), path
    assert not [p for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline())]
