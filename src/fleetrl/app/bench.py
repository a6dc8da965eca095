"""`fleetrl bench`: the benchmark suites of `benchmarks/`, run one after the other, their ratios
in one table and in one JSON file.

Each benchmark script measures its figures side by side within its own run (the machines are
shared and noisy: only a ratio measured in one run means anything) and records each one with
`benchmarks/bench_report.record`, which appends a JSON line to the file named by RESULTS_ENV.
This command only runs the scripts, streams their output, and gathers what they recorded. The
scripts are part of the source checkout, not of the installed package: `fleetrl bench` runs from
a checkout.

    fleetrl bench [--suite fleet|dynamo|rl|publish|trainer|cpu-lora|engine-start|trl|all] [--quick] [--out bench.json]
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fleetrl.errors import FleetrlError
from fleetrl.files import atomic_write

RESULTS_ENV = "FLEETRL_BENCH_RESULTS"
# benchmarks/ of the checkout this module was imported from (src/fleetrl/app/bench.py).
BENCHMARKS_DIR = Path(__file__).resolve().parents[3] / "benchmarks"


@dataclass(frozen=True)
class Suite:
    script: str
    quick: tuple[str, ...]  # the script's flags for --quick: fewer repetitions, shorter runs
    measures: str
    needs: str | None = None  # a module of an extra the suite needs; skipped (and said so) without it
    flags: tuple[str, ...] = ()  # the script's flags that make this suite of it, always given


SUITES = {
    "fleet": Suite("bench_fleet.py", ("--reps", "1", "--max-tokens", "16"),
                   "native fleet: publish against a bare broadcast, fence, data plane, the agreement probe"),
    "dynamo": Suite("bench_dynamo.py", ("--reps", "1", "--max-tokens", "16"),
                    "Dynamo against native: rollouts and publish"),
    "rl": Suite("bench_rl.py", ("--steps", "3"),
                "fleetrl rl: step time at k = 1 against k = 0"),
    "publish": Suite("bench_rl.py", ("--steps", "4", "--max-tokens", "128"),
                     "fleetrl rl: sampling throughput around publishes and step time, rolling against fenced",
                     flags=("--publish",)),
    "trainer": Suite("bench_trainer.py", ("--reps", "1"),
                     "trainer step against a bare transformers + torch step, and 2 ranks against 1"),
    "cpu-lora": Suite("bench_cpu_lora.py", ("--reps", "2"),
                      "vLLM's CPU LoRA ops against fleetrl's per-adapter products, per call"),
    "engine-start": Suite("bench_engine_start.py", ("--reps", "1"),
                          "a launched vLLM CPU server's start: its engine core forked, against spawned, "
                          "against vLLM's default (a worker process of its own)"),
    "trl": Suite("bench_trl.py", ("--steps", "3"),
                 "fleetrl against TRL's GRPOTrainer: time per step, time to a reward level, held-out "
                 "reward (the `bench` extra)", needs="trl"),
}
BENCH_EXTRA = "pip install -e '.[bench]'"
SUITE_CHOICES = [*SUITES, "all"]


def run_bench(suite: str, quick: bool, out: Path, log=print) -> int:
    """Run `suite` (a name of SUITE_CHOICES: the CLI checks it), print the ratio table, write
    `out`; 1 if a suite failed, else 0."""
    names = list(SUITES) if suite == "all" else [suite]
    benchmarks_dir = BENCHMARKS_DIR
    missing = [SUITES[n].script for n in names if not (benchmarks_dir / SUITES[n].script).is_file()]
    if missing:
        raise FleetrlError(f"fleetrl bench runs the scripts of a source checkout's benchmarks/; "
                           f"{', '.join(missing)} not found in {benchmarks_dir}")
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": quick,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "suites": {}}
    for i, name in enumerate(names, 1):
        needs = SUITES[name].needs
        if needs and not installed(needs):
            log(f"fleetrl bench: [{i}/{len(names)}] {name}: skipped: it needs {needs} ({BENCH_EXTRA})")
            report["suites"][name] = {"skipped": f"needs {needs} ({BENCH_EXTRA})", "figures": []}
            continue
        log(f"fleetrl bench: [{i}/{len(names)}] {name}: {SUITES[name].measures}")
        report["suites"][name] = _run_suite(name, quick, benchmarks_dir, log)
        result = report["suites"][name]
        log(f"fleetrl bench: [{i}/{len(names)}] {name}: {'done' if result['returncode'] == 0 else 'FAILED'} "
            f"in {result['seconds']:.0f} s, {len(result['figures'])} figure(s)")
    atomic_write(out, json.dumps(report, indent=1))
    log("\n" + ratio_table(report))
    log(f"\nfleetrl bench: results in {out}")
    return 0 if all(r.get("returncode", 0) == 0 for r in report["suites"].values()) else 1


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _run_suite(name: str, quick: bool, benchmarks_dir: Path, log) -> dict:
    suite = SUITES[name]
    flags = [*suite.flags, *(suite.quick if quick else ())]
    argv = [sys.executable, str(benchmarks_dir / suite.script), *flags]
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.jsonl"
        started = time.monotonic()
        # The script's output goes straight to ours: its progress is this command's progress.
        proc = subprocess.run(argv, env={**os.environ, RESULTS_ENV: str(results)}, cwd=benchmarks_dir.parent)
        seconds = time.monotonic() - started
        lines = results.read_text().splitlines() if results.exists() else []
    figures = [json.loads(line) for line in lines]
    if proc.returncode != 0:
        log(f"fleetrl bench: {name} exited with code {proc.returncode}")
    # The command as a user re-runs it from the checkout.
    command = ["python", f"{benchmarks_dir.name}/{suite.script}", *flags]
    return {"command": command, "returncode": proc.returncode, "seconds": round(seconds, 1), "figures": figures}


def ratio_table(report: dict) -> str:
    rows = [("suite", "figure", "ratio", "detail")]
    for name, result in report["suites"].items():
        for figure in result["figures"]:
            rows.append((name, figure["figure"], f"{figure['ratio']:.2f}", figure.get("detail", "")))
        if "skipped" in result:
            rows.append((name, "(skipped)", "-", result["skipped"]))
        elif result["returncode"] != 0:
            rows.append((name, "(failed)", "-", f"exit code {result['returncode']}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[3]]).rstrip() for row in rows)
