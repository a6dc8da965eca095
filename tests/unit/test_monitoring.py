"""Each step's metrics in TensorBoard event files and in an offline W&B run (real packages)."""

import psutil

from fleetrl.config import Config
from fleetrl.monitoring import Monitors, scalars

LINE = {"step": 1, "reward_mean": 0.25, "loss": None, "dropped": 0, "checksum": "abc", "rollout_started": 1e9,
        "worker_versions": {"w0": 1},
        "workers": {"w0": {"version": 1, "completions": 8, "completion_tokens": 96, "tokens_per_s": 12.0,
                           "publish_s": 0.5}}}


def test_scalars_are_the_numbers_of_a_line_and_each_workers():
    assert scalars(LINE) == {"reward_mean": 0.25, "dropped": 0.0, "worker/w0/version": 1.0,
                             "worker/w0/completions": 8.0, "worker/w0/completion_tokens": 96.0,
                             "worker/w0/tokens_per_s": 12.0, "worker/w0/publish_s": 0.5}


def test_steps_reach_tensorboard_and_wandb_offline_without_the_tokens(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = Config()
    config.run.wandb = True
    config.inference.admin_token = "secret-admin-token-123"
    monitors = Monitors(config.run, config, tmp_path / "tensorboard", tmp_path / "wandb", log=lambda *_: None)
    monitors.log(LINE)
    monitors.log({**LINE, "step": 2, "reward_mean": 0.75})
    monitors.close()
    monitors.close()  # idempotent

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [e.value for e in events.Scalars("worker/w0/tokens_per_s")] == [12.0, 12.0]
    (run,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    assert list(run.glob("*.wandb")), list(run.iterdir())
    for path in (tmp_path / "wandb").rglob("*"):
        if path.is_file():
            assert b"secret-admin-token-123" not in path.read_bytes(), path
    assert not [p for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline())]
