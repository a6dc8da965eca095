"""The run's two plots, from metrics.jsonl: mean reward and off-policy distance per step."""

from __future__ import annotations

from pathlib import Path


def write_plots(run_dir: Path, metrics: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # no display; files only
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    figures = {
        "reward.png": ("mean reward", [("reward mean", [m["reward_mean"] for m in metrics])]),
        "off_policy.png": ("off-policy distance", [
            ("max", [m["distance_max"] for m in metrics]),
            ("mean", [m["distance_mean"] for m in metrics]),
        ]),
    }
    written = []
    for name, (ylabel, series) in figures.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, values in series:
            ax.plot(steps, values, marker="o", label=label)
        ax.set_xlabel("trainer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=100)
        plt.close(fig)
        written.append(run_dir / name)
    return written
