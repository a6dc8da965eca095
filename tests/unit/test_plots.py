"""`fleetrl plot RUN_DIR`: the run's plots drawn from its records; the version timeline's picture."""

import io
import json

import numpy as np

from fleetrl.cli import main
from fleetrl.config import Config, to_toml

from .step_lines import step_dict

T = 1000.0


def worker(t, worker, state, version):
    return {"t": T + t, "event": "worker", "worker": worker, "role": "aggregated", "state": state,
            "version": version, "error": None}


def sample(t0, t1, step, spans, tokens=10, group=0, index=0):
    return {"t": T + t1, "event": "sample", "step": step, "group": group, "sample": index, "worker": "w0",
            "start": T + t0, "end": T + t1, "tokens": tokens, "spans": spans}


EVENTS = [
    worker(0, "w0", "ready", 0), worker(0, "w1", "ready", 0),
    sample(0, 4, 1, [[0, 0]]),
    {"t": T + 4, "event": "fence", "phase": "start", "version": 1},
    worker(4, "w0", "paused", 0), worker(4, "w0", "updating", 0), worker(6, "w0", "ready", 1),
    worker(4, "w1", "paused", 0), worker(4, "w1", "updating", 0), worker(6, "w1", "stale", 0),
    {"t": T + 6, "event": "fence", "phase": "end", "version": 1, "ready": ["w0"]},
    sample(3, 9, 2, [[0, 0], [1, 5]], index=1),  # crossed the fence: half v0, half v1
    sample(1, 9, 4, [[0, 0]], group=1),  # 3 versions behind step 4: dropped at k = 1
    {"t": T + 4, "event": "train", "step": 1, "start": T + 4.5, "end": T + 5.5},
]


def colors_in(png: bytes) -> set[tuple[int, int, int]]:
    import matplotlib.image

    pixels = (matplotlib.image.imread(io.BytesIO(png))[..., :3] * 255).round().astype(np.uint8)
    return set(map(tuple, pixels.reshape(-1, 3)))


def rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))


def test_plot_draws_the_timeline_from_the_events_and_the_same_bytes_again(tmp_path, capsys):
    from fleetrl.plots import DROPPED_COLOR, STATE_STYLES, TRAIN_COLOR

    run = tmp_path / "run"
    run.mkdir()
    config = Config()
    config.orchestrator.max_off_policy_steps = 1
    (run / "config.toml").write_text(to_toml(config))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    (run / "metrics.jsonl").write_text(json.dumps(step_dict(1, batch={"reward_mean": 0.5}, update={
        "max_off_policy": 0, "mean_off_policy": 0.0})) + "\n")
    assert main(["plot", str(run)]) == 0
    out = capsys.readouterr().out
    pngs = {name: (run / name).read_bytes() for name in ("reward.png", "off_policy.png", "timeline.png")}
    assert all(f"wrote {run / name}" in out for name in pngs)
    colors = colors_in(pngs["timeline.png"])
    # v0 and v1 (tab10's first two), the fence band, an updating worker, the dropped sample's outline, a step
    for color in ("#1f77b4", "#ff7f0e", "#fff3b0", STATE_STYLES["updating"][0], DROPPED_COLOR, TRAIN_COLOR):
        assert rgb(color) in colors, color
    assert main(["plot", str(run)]) == 0
    assert {name: (run / name).read_bytes() for name in pngs} == pngs  # a finished run keeps its manifest
    assert not (run / "eval.png").exists()  # the run has not evaluated


def test_the_timeline_draws_each_wave_of_a_rolling_publish_on_its_own_workers():
    from fleetrl.plots import _fences, timeline_plot
    from fleetrl.records import read_event

    waves = [{"t": T + 1, "event": "fence", "phase": "start", "version": 1, "wave": 1, "canary": True, "workers": ["w0"]},
             {"t": T + 2, "event": "fence", "phase": "end", "version": 1, "ready": ["w0"], "wave": 1, "canary": True},
             {"t": T + 3, "event": "fence", "phase": "start", "version": 1, "wave": 2, "canary": False, "workers": ["w1"]}]
    events = [read_event(e, "events.jsonl") for e in EVENTS[:4] + EVENTS[10:11] + waves]
    assert _fences(events, T + 9) == [(T + 4, T + 6, 1, None, []), (T + 1, T + 2, 1, 1, ["w0"]), (T + 3, T + 9, 1, 2, ["w1"])]
    assert rgb("#fff3b0") in colors_in(timeline_plot(events, k=1))


def test_plot_draws_each_evaluated_environments_reward_and_pass_at_1_per_version(tmp_path, capsys):
    """eval.png: a line per figure and environment, over the evaluated versions; a figure an
    evaluation does not have (None, or an environment it did not evaluate) is a gap, not an error."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(Config()))
    (run / "metrics.jsonl").write_text(json.dumps(step_dict(1, batch={"reward_mean": 0.5}, update={
        "max_off_policy": 0, "mean_off_policy": 0.0})) + "\n")
    counts = {"prompts": 2, "samples": 2, "failed": 0}
    figures = {**counts, "reward_mean": 0.3, "pass@1": 0.0}
    evals = [{"version": 0, "envs": {"reverse_text": figures}},
             {"version": 5, "envs": {"reverse_text": {**counts, "reward_mean": None, "pass@1": None},
                                     "arithmetic": figures}},
             {"version": 10, "envs": {"reverse_text": {**counts, "reward_mean": 0.6, "pass@1": 0.25},
                                      "arithmetic": figures}}]
    (run / "eval.jsonl").write_text("".join(json.dumps({"started": T, "seconds": 1.0, **e}) + "\n" for e in evals))
    assert main(["plot", str(run)]) == 0
    assert f"wrote {run / 'eval.png'}" in capsys.readouterr().out
    colors = colors_in((run / "eval.png").read_bytes())
    # four lines in matplotlib's first four colours: each environment's reward mean and pass@1
    for color in ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"):
        assert rgb(color) in colors, color


def test_plot_refuses_what_is_no_run(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 1
    assert "no config.toml (not a run directory)" in capsys.readouterr().err
    (tmp_path / "config.toml").write_text(to_toml(Config()))
    assert main(["plot", str(tmp_path)]) == 1
    assert "nothing to draw yet" in capsys.readouterr().err
    assert main(["plot"]) == 1
    assert "fleetrl plot needs a run directory" in capsys.readouterr().err
