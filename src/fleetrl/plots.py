"""The run's plots: mean reward and off-policy distance per step (from its metrics lines), the
held-out figures per evaluated version (from eval.jsonl), and the version timeline (from its
events).

They are rendered to PNG bytes; the run directory (fleetrl.rundir) writes them.
"""

from __future__ import annotations

import io

from fleetrl.records import (EvalLine, FenceEvent, FlatStepLine, FleetEvent, SampleEvent, StepLine, TrainEvent,
                             WorkerEvent, reward_mean, trained_distance)
from fleetrl.versions import VersionSpan, off_policy_distance

# A worker serving ("ready") is drawn in its version's colour, full height; every other state
# as a narrower bar in grey or black, hatched, so none can be taken for a version's colour.
STATE_STYLES = {"joining": ("#eeeeee", ""), "syncing": ("#d0d0d0", ".."), "paused": ("#bdbdbd", "//"),
                "updating": ("#616161", "xx"), "stale": ("#ffffff", "\\\\"), "dead": ("#000000", "")}
FENCE_COLOR = "#fff3b0"
TRAIN_COLOR = "#37474f"  # a trainer step, from its batch to its optimizer step
DROPPED_COLOR = "#ff00aa"  # the outline of a sample more than k versions behind


def reward_plot(metrics: list[StepLine | FlatStepLine]) -> bytes:
    return _plot([m.step for m in metrics], "trainer step", "mean reward",
                 {"reward mean": [reward_mean(m) for m in metrics]})


def off_policy_plot(metrics: list[StepLine | FlatStepLine]) -> bytes:
    return _plot([m.step for m in metrics], "trainer step", "off-policy distance", {
        "max": [trained_distance(m)[0] for m in metrics],
        "mean": [trained_distance(m)[1] for m in metrics],
    })


def eval_plot(evals: list[EvalLine]) -> bytes:
    """Each evaluated environment's held-out mean reward and pass@1 per evaluated version (eval.jsonl's
    lines). Version N is the policy after N trainer steps. A figure an evaluation does not have is
    a gap in its line: None (every completion failed), or an environment it did not evaluate (a
    resume may change eval.envs)."""
    names = list(dict.fromkeys(name for e in evals for name in e.envs))
    series = {}
    for name in names:
        figures = [e.envs.get(name) for e in evals]
        series[f"{name} reward mean"] = [_number(None if f is None else f.reward_mean) for f in figures]
        series[f"{name} pass@1"] = [_number(None if f is None else f.pass_at.get(1)) for f in figures]
    return _plot([e.version for e in evals], "policy version (trainer steps done)", "held-out evaluation", series)


def timeline_plot(events: list[FleetEvent], k: int) -> bytes:
    """Each trainer step and each worker's state over wall time (serving at vN in vN's colour,
    paused, updating, ...), publish fences as vertical bands (a rolling publish's waves on their
    own workers' rows), and below, one bar per sample from its start to its end,
    split where its tokens change version (at the token position, the bar read as the tokens in
    order) and coloured by version. A sample whose tokens lie more than `k` versions behind its
    step is outlined in magenta (the orchestrator dropped it)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    t0 = min((e.t for e in events), default=0.0)
    t_end = max((max(e.t, getattr(e, "end", e.t)) for e in events), default=1.0)
    workers = sorted({e.worker for e in events if isinstance(e, WorkerEvent)})
    rows = workers + ["trainer"]  # the trainer's steps on the top row, above the workers
    samples = sorted((e for e in events if isinstance(e, SampleEvent)), key=lambda e: (e.start, e.step, e.group, e.sample))
    versions = sorted({v for e in events for v in _versions_of(e)} or {0})
    color = _version_colors(versions)

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 2.5 + 0.35 * len(rows) + min(6.0, 0.06 * len(samples))),
                                      gridspec_kw={"height_ratios": [len(rows), max(2, min(12, len(samples) // 6))]})
    for start, end, version, wave, fenced in _fences(events, t_end):
        if wave is None:  # a fenced publish: the whole fleet
            for ax in (top, bottom):
                ax.axvspan(start - t0, end - t0, color=FENCE_COLOR, zorder=0)
            top.text(start - t0, len(rows) - 0.45, f"v{version}", fontsize=7, va="bottom")
            continue
        # A wave of a rolling publish: its workers' rows alone, the rest of the fleet serving.
        wave_rows = [workers.index(w) for w in fenced if w in workers]
        for row in wave_rows:
            top.barh(row, end - start, left=start - t0, height=1.0, color=FENCE_COLOR, zorder=0)
        top.text(start - t0, max(wave_rows, default=0) + 0.3, f"v{version}/{wave}", fontsize=7, va="bottom")
    for row, worker in enumerate(workers):
        for start, end, state, version in _states(events, worker, t_end):
            if state == "ready" and version is not None:
                top.barh(row, end - start, left=start - t0, height=0.6, color=color[version], edgecolor="none")
            else:
                fill, hatch = STATE_STYLES.get(state, ("#ffffff", ""))
                top.barh(row, end - start, left=start - t0, height=0.3, color=fill, hatch=hatch, edgecolor="#212121",
                         linewidth=0.5)
    for train in (e for e in events if isinstance(e, TrainEvent)):
        top.barh(len(workers), train.end - train.start, left=train.start - t0, height=0.6, color=TRAIN_COLOR)
    top.set_yticks(range(len(rows)), rows, fontsize=7)
    top.set_ylim(-0.5, len(rows))
    top.set_title("trainer steps, and workers serving at vN in vN's colour (thin, hatched: not serving); "
                  "publish fences in yellow", fontsize=9)
    for row, sample in enumerate(samples):
        duration = sample.end - sample.start
        spans = [VersionSpan(v, start) for v, start in sample.spans]
        tokens = max(1, sample.tokens)
        for i, span in enumerate(spans):
            stop = spans[i + 1].start if i + 1 < len(spans) else tokens
            bottom.barh(row, duration * (stop - span.start) / tokens, left=sample.start - t0 + duration * span.start / tokens,
                        height=0.8, color=color[span.version], edgecolor="none")
        if spans and off_policy_distance(sample.step, spans) > k:
            bottom.barh(row, duration, left=sample.start - t0, height=0.8, fill=False, edgecolor=DROPPED_COLOR, linewidth=1.5)
    bottom.set_ylabel("samples", fontsize=8)
    bottom.set_yticks([])
    bottom.set_ylim(-0.5, max(1, len(samples)) - 0.5)
    bottom.set_xlabel("wall time (s)")
    bottom.set_title(f"samples, coloured by the version of their tokens (k = {k}; magenta outline: more than k behind, dropped)",
                     fontsize=9)
    handles = [Patch(color=color[v], label=f"v{v}") for v in versions[:12]]
    handles += [Patch(facecolor=fill, hatch=hatch, edgecolor="#212121", label=state)
                for state, (fill, hatch) in STATE_STYLES.items() if state != "joining"]
    fig.legend(handles=handles, loc="center right", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    return _png(fig)


def _versions_of(event: FleetEvent) -> list[int]:
    if isinstance(event, SampleEvent):
        return [v for v, _ in event.spans]
    if isinstance(event, WorkerEvent) and event.version is not None:
        return [event.version]
    return []


def _version_colors(versions: list[int]) -> dict[int, str]:
    """A distinct colour per version where there are few; a gradient where there are many."""
    import matplotlib

    if len(versions) <= 10:
        palette = matplotlib.colormaps["tab10"]
        return {v: matplotlib.colors.to_hex(palette(i)) for i, v in enumerate(versions)}
    gradient = matplotlib.colormaps["viridis"]
    return {v: matplotlib.colors.to_hex(gradient(i / (len(versions) - 1))) for i, v in enumerate(versions)}


def _fences(events: list[FleetEvent], t_end: float) -> list[tuple[float, float, int, int | None, list[str]]]:
    """(start, end, version, wave, workers) of each publish fence: wave None and no workers for a
    fenced publish (the whole fleet), else one wave of a rolling publish and the workers it
    fenced. One the run did not see end ends with the run."""
    fences, open_at = [], {}
    for event in events:
        if isinstance(event, FenceEvent):
            key = event.version, event.wave
            if event.phase == "start":
                open_at[key] = event.t, event.workers or []
            elif key in open_at:
                start, workers = open_at.pop(key)
                fences.append((start, event.t, *key, workers))
    return fences + [(start, t_end, *key, workers) for key, (start, workers) in open_at.items()]


def _states(events: list[FleetEvent], worker: str, t_end: float) -> list[tuple[float, float, str, int | None]]:
    """(start, end, state, version) of each stretch of one worker's states."""
    changes = [e for e in events if isinstance(e, WorkerEvent) and e.worker == worker]
    ends = [e.t for e in changes[1:]] + [t_end]
    return [(e.t, end, e.state, e.version) for e, end in zip(changes, ends)]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; files only
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    _pyplot().close(fig)
    return png.getvalue()


def _number(figure: float | None) -> float:
    return float("nan") if figure is None else figure


def _plot(x: list[int], xlabel: str, ylabel: str, series: dict[str, list[float]]) -> bytes:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, values in series.items():
        ax.plot(x, values, marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _png(fig)
