"""The run's two plots, from its metrics lines: mean reward and off-policy distance per step.

They are rendered to PNG bytes; the run directory (fleetrl.rundir) writes them.
"""

from __future__ import annotations

import io


def reward_plot(metrics: list[dict]) -> bytes:
    return _plot(metrics, "mean reward", {"reward mean": [m["reward_mean"] for m in metrics]})


def off_policy_plot(metrics: list[dict]) -> bytes:
    return _plot(metrics, "off-policy distance", {
        "max": [m["distance_max"] for m in metrics],
        "mean": [m["distance_mean"] for m in metrics],
    })


def _plot(metrics: list[dict], ylabel: str, series: dict[str, list[float]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # no display; files only
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, values in series.items():
        ax.plot(steps, values, marker="o", label=label)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return png.getvalue()
