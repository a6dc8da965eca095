"""Step time of `fleetrl rl` with one step of overlap (k = 1) against strictly on-policy (k = 0).

    .venv/bin/python benchmarks/bench_rl.py [--steps 8] [--workers 1] [--world-size 1] [--core-plan off|auto]

Runs the same job twice, back to back, differing only in `orchestrator.max_off_policy_steps`,
and compares the wall time per step measured from the runs' own timestamps (from the first
rollout of step 2 to the end of the last step, so the fleet's start-up and the first step,
which cannot overlap anything, are left out). Results go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_report import record


def run(k: int, args, root: Path) -> dict:
    run_dir = root / f"k{k}"
    cmd = [sys.executable, "-m", "fleetrl", "rl", "@", "configs/default.toml",
           "--run.dir", str(run_dir), "--run.max_steps", str(args.steps),
           "--orchestrator.max_off_policy_steps", str(k),
           "--inference.workers", str(args.workers), "--trainer.world_size", str(args.world_size),
           "--trainer.checkpoint_interval", "0", "--run.core_plan", args.core_plan]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = metrics[1:]
    seconds = (steady[-1]["train_finished"] - steady[0]["rollout_started"]) / len(steady)
    rollout = sum(m["rollout_finished"] - m["rollout_started"] for m in steady) / len(steady)
    train = sum(m["train_finished"] - m["train_started"] for m in steady) / len(steady)
    publish = sum(m["publish_s"] for m in steady) / len(steady)
    return {"step_s": seconds, "rollout_s": rollout, "train_s": train, "publish_s": publish,
            "distance_max": max(m["distance_max"] for m in metrics)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--core-plan", choices=["off", "auto"], default="off",
                        help="run.core_plan of both runs: auto gives the worker and the trainer CPUs of their own")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {k: run(k, args, Path(tmp)) for k in (0, 1)}
    for k, r in results.items():
        print(f"k = {k}: {r['step_s']:.1f} s/step (rollouts {r['rollout_s']:.1f} s, train {r['train_s']:.1f} s, "
              f"publish {r['publish_s']:.1f} s per step; max off-policy distance {r['distance_max']})")
    ratio = results[1]["step_s"] / results[0]["step_s"]
    print(f"ratio step time k=1 / k=0: {ratio:.2f}")
    on_policy = results[0]  # each part as it takes alone, without overlap
    ideal = (on_policy["train_s"] + on_policy["publish_s"]) / (
        on_policy["rollout_s"] + on_policy["train_s"] + on_policy["publish_s"])
    print(f"ideal (train + publish) / (rollouts + train + publish): {ideal:.2f}")
    record(f"step time, k = 1 / k = 0 (core plan {args.core_plan})", ratio,
           f"{results[1]['step_s']:.1f} vs {results[0]['step_s']:.1f} s/step, {args.steps} steps; ideal {ideal:.2f}")


if __name__ == "__main__":
    main()
