"""Step time of `fleetrl rl` with one step of overlap (k = 1) against strictly on-policy (k = 0),
and what each run costs before its first step and in memory.

    .venv/bin/python benchmarks/bench_rl.py [--steps 8] [--workers 1] [--world-size 1] [--core-plan off|auto]
                                            [--batch-prompts N]
    .venv/bin/python benchmarks/bench_rl.py --memory [--steps 2]
    .venv/bin/python benchmarks/bench_rl.py --lora [--steps 10]
    .venv/bin/python benchmarks/bench_rl.py --publish [--steps 8] [--max-tokens 256] [--window-s 5]
    .venv/bin/python benchmarks/bench_rl.py --openmp-wait [--steps 3] [--repeats 3]
    .venv/bin/python benchmarks/bench_rl.py --eval-beside-sft [--repeats 2]

Runs the same job twice, back to back, differing only in `orchestrator.max_off_policy_steps`,
and compares the wall time per step measured from the runs' own timestamps (from the end of
step 1's training to the end of the last step's, so the fleet's start-up and the first step,
which cannot overlap anything, are left out).

Each run also reports its time to first rollout and to the end of its first step (from the
launch of `fleetrl rl`), and the peak resident memory of the trainer (the `fleetrl rl` process
and its trainer ranks) and of each inference worker (its server, engine core and the engine's
workers), sampled every 0.5 s from /proc. Results go to docs/benchmarks.md.

With --memory it runs k = 1 only, three times: as configured, with twice the prompts per batch,
and with one worker more, and reports how each peak grows with batch size and with workers.

With --lora it runs k = 1 twice, full fine-tuning and `@ configs/lora.toml` (a rank-16 adapter),
and compares step time, publish time, peak memory and the reward after the same steps (the
mean training reward of the last three steps: the same prompts, as both runs draw them from the
same seed).

With --openmp-wait it runs k = 1 --repeats times in each of two ways, alternating: as `fleetrl rl`
sets OpenMP by default (OMP_WAIT_POLICY=PASSIVE: a thread out of work sleeps), and with
GOMP_SPINCOUNT=300000 (a thread spins about 3 ms first: GNU OpenMP's default, which torch's
threads had before fleetrl set the policy). It compares the time from launch to the end of the
last step, step 1's training (which overlaps the sampling of step 2) and step 2's sampling.

With --eval-beside-sft it runs docs/examples.md's first two commands side by side, the base
model's `fleetrl eval` and one step of `fleetrl sft`, --repeats times each way, alternating:
their OpenMP threads sleeping (every fleetrl command's default) and spinning; and once one after
the other, for the time the pair takes without sharing the CPUs. It compares each command's
wall time, the evaluation's and the training step's own times.

With --publish it runs a sampling-bound job (2 workers, k = 1, long completions) twice,
`inference.publish = "fenced"` against `"rolling"` (waves of one worker), and compares the step
time, `mismatch_kl` on every step, and the fleet's sampling throughput: the tokens/s of all
workers while sampling had work (each sample's tokens spread evenly over its time on its
unfenced worker, from events.jsonl; `sampling_throughput` says how) in the windows of --window-s
seconds that hold a publish's fence, as a fraction of those that hold none; and the same during
the fences alone.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import psutil
from bench_report import record

from fleetrl.contract import NATIVE_SERVER_MODULE
from fleetrl.records import FenceEvent, SampleEvent
from fleetrl.rundir import RunDir

SAMPLE_S = 0.5


def rss_by_role(root: psutil.Process) -> dict[str, int]:
    """Resident bytes now of the trainer (`root` and its trainer ranks) and of each worker (a
    server with everything under it), keyed "trainer" and "worker-<pid>"."""
    roles = {"trainer": _rss(root)}
    for child in root.children():
        try:
            tree = [child, *child.children(recursive=True)]
            key = f"worker-{child.pid}" if NATIVE_SERVER_MODULE in " ".join(child.cmdline()) else "trainer"
            roles[key] = roles.get(key, 0) + sum(_rss(p) for p in tree)
        except psutil.Error:
            continue  # it ended while we looked
    return roles


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return 0


def run(k: int, args, root: Path, batch_prompts: int | None = None, workers: int | None = None,
        overlay: str | None = None, flags: tuple[str, ...] = (), label: str = "",
        env: dict[str, str] | None = None) -> dict:
    batch_prompts = args.batch_prompts if batch_prompts is None else batch_prompts
    workers = args.workers if workers is None else workers
    run_dir = root / f"k{k}-b{batch_prompts}-w{workers}{'-' + Path(overlay).stem if overlay else ''}{label}"
    cmd = [sys.executable, "-m", "fleetrl", "rl", "@", "configs/default.toml", *(["@", overlay] if overlay else []),
           "--run.dir", str(run_dir), "--run.max_steps", str(args.steps),
           "--orchestrator.max_off_policy_steps", str(k),
           "--inference.workers", str(workers), "--trainer.world_size", str(args.world_size),
           "--trainer.checkpoint_interval", "0", "--run.core_plan", args.core_plan]
    if batch_prompts is not None:
        cmd += ["--orchestrator.batch_prompts", str(batch_prompts)]
    cmd += flags
    launched = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    root = psutil.Process(proc.pid)
    peak: dict[str, int] = {}
    while proc.poll() is None:
        for role, rss in rss_by_role(root).items():
            peak[role] = max(peak.get(role, 0), rss)
        time.sleep(SAMPLE_S)
    if proc.returncode != 0:
        raise SystemExit(f"bench_rl: {' '.join(cmd)} failed ({proc.returncode})")
    metrics = RunDir(run_dir).read_metrics()
    steady = metrics[1:]
    # From the end of step 1's training to the end of the last's, per step: at k = 1 a step's
    # rollouts start during the previous step's training, so a window opened at the first
    # steady rollout would hold more than its steps and charge k = 1 for its own overlap.
    seconds = (steady[-1].train_finished - metrics[0].train_finished) / len(steady)
    rollout = sum(m.batch.rollout_finished - m.batch.rollout_started for m in steady) / len(steady)
    train = sum(m.train_finished - m.train_started for m in steady) / len(steady)
    publish = sum(m.publish.seconds for m in steady) / len(steady)
    workers = sorted(v for role, v in peak.items() if role.startswith("worker-"))
    return {"run_dir": run_dir, "step_s": seconds, "rollout_s": rollout, "train_s": train, "publish_s": publish,
            "distance_max": max(m.update.max_off_policy for m in metrics),
            "mismatch_kl": [m.update.mismatch_kl for m in metrics],
            "reward_last3": sum(m.batch.reward_mean for m in metrics[-3:]) / len(metrics[-3:]),
            "first_rollout_s": metrics[0].batch.rollout_started - launched,
            "first_step_s": metrics[0].train_finished - launched,
            "last_step_s": metrics[-1].train_finished - launched,
            "first_train_s": metrics[0].train_finished - metrics[0].train_started,
            "second_rollout_s": steady[0].batch.rollout_finished - steady[0].batch.rollout_started,
            "trainer_peak_gib": peak.get("trainer", 0) / 2**30, "worker_peak_gib": [w / 2**30 for w in workers]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--core-plan", choices=["off", "auto"], default="off",
                        help="run.core_plan of both runs: auto gives the worker and the trainer CPUs of their own")
    parser.add_argument("--batch-prompts", type=int, default=None,
                        help="orchestrator.batch_prompts of both runs (default: configs/default.toml's)")
    parser.add_argument("--memory", action="store_true",
                        help="k = 1 only: as configured, with twice the batch, and with one worker more")
    parser.add_argument("--lora", action="store_true",
                        help="k = 1 only: full fine-tuning against configs/lora.toml's adapter")
    parser.add_argument("--publish", action="store_true",
                        help="k = 1, 2 workers (--workers is not read), long completions: fenced publishes "
                             "against rolling ones")
    parser.add_argument("--openmp-wait", action="store_true",
                        help="k = 1 only: OpenMP threads that sleep when out of work against threads that spin")
    parser.add_argument("--eval-beside-sft", action="store_true",
                        help="the worked example's base evaluation beside its warm start's first step, OpenMP "
                             "threads sleeping against spinning")
    parser.add_argument("--repeats", type=int, default=3, help="--openmp-wait, --eval-beside-sft: runs of each way")
    parser.add_argument("--max-tokens", type=int, default=256, help="--publish: orchestrator.max_tokens")
    parser.add_argument("--window-s", type=float, default=5.0, help="--publish: the throughput windows' length")
    args = parser.parse_args()
    if args.publish:
        fenced_against_rolling(args)
        return
    if args.memory:
        memory_growth(args)
        return
    if args.lora:
        lora_against_full(args)
        return
    if args.openmp_wait:
        sleeping_against_spinning(args)
        return
    if args.eval_beside_sft:
        eval_beside_sft(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = {k: run(k, args, Path(tmp)) for k in (0, 1)}
    for k, r in results.items():
        print(f"k = {k}: " + describe(r))
    ratio = results[1]["step_s"] / results[0]["step_s"]
    print(f"ratio step time k=1 / k=0: {ratio:.2f}")
    on_policy = results[0]  # each part as it takes alone, without overlap
    ideal = (on_policy["train_s"] + on_policy["publish_s"]) / (
        on_policy["rollout_s"] + on_policy["train_s"] + on_policy["publish_s"])
    print(f"ideal (train + publish) / (rollouts + train + publish): {ideal:.2f}")
    record(f"step time, k = 1 / k = 0 (core plan {args.core_plan})", ratio,
           f"{results[1]['step_s']:.1f} vs {results[0]['step_s']:.1f} s/step, {args.steps} steps; ideal {ideal:.2f}")
    first = results[1]  # the default run's k
    record("time to first step / one steady step (k = 1)", first["first_step_s"] / first["step_s"],
           f"first rollout {first['first_rollout_s']:.1f} s, first step done {first['first_step_s']:.1f} s after launch")
    record("peak RSS, workers / trainer (k = 1)", sum(first["worker_peak_gib"]) / first["trainer_peak_gib"],
           f"trainer {first['trainer_peak_gib']:.2f} GiB, workers "
           + ", ".join(f"{w:.2f}" for w in first["worker_peak_gib"]) + f" GiB ({args.workers} worker(s))")


def describe(r: dict) -> str:
    return (f"{r['step_s']:.1f} s/step (rollouts {r['rollout_s']:.1f} s, train {r['train_s']:.1f} s, "
            f"publish {r['publish_s']:.1f} s per step; max off-policy distance {r['distance_max']})\n"
            f"  first rollout {r['first_rollout_s']:.1f} s and first step done {r['first_step_s']:.1f} s after launch; "
            f"peak RSS trainer {r['trainer_peak_gib']:.2f} GiB, workers "
            + ", ".join(f"{w:.2f}" for w in r["worker_peak_gib"]) + " GiB")


def lora_against_full(args) -> None:
    """The same job, full fine-tuning and a rank-16 LoRA adapter, back to back."""
    with tempfile.TemporaryDirectory() as tmp:
        results = {"full": run(1, args, Path(tmp)), "lora": run(1, args, Path(tmp), overlay="configs/lora.toml")}
    for name, r in results.items():
        print(f"{name}: reward over the last 3 of {args.steps} steps {r['reward_last3']:.3f}; " + describe(r))
    full, lora = results["full"], results["lora"]
    for label, ratio, detail in [
        ("step time, LoRA / full fine-tuning (k = 1)", lora["step_s"] / full["step_s"],
         f"{lora['step_s']:.1f} vs {full['step_s']:.1f} s/step"),
        ("publish time in a run, LoRA / full fine-tuning", lora["publish_s"] / full["publish_s"],
         f"{lora['publish_s']:.2f} vs {full['publish_s']:.2f} s"),
        ("peak RSS trainer, LoRA / full fine-tuning", lora["trainer_peak_gib"] / full["trainer_peak_gib"],
         f"{lora['trainer_peak_gib']:.2f} vs {full['trainer_peak_gib']:.2f} GiB"),
        (f"reward of the last 3 of {args.steps} steps, LoRA / full fine-tuning", lora["reward_last3"] / full["reward_last3"],
         f"{lora['reward_last3']:.3f} vs {full['reward_last3']:.3f}"),
    ]:
        print(f"{label}: {ratio:.2f} ({detail})")
        record(label, ratio, detail)


# GNU OpenMP's spin before a thread out of work sleeps, when no OMP_WAIT_POLICY is set; it
# overrides the policy fleetrl sets.
SPINNING = {"GOMP_SPINCOUNT": "300000"}


def sleeping_against_spinning(args) -> None:
    """The same job, its OpenMP threads sleeping when out of work (fleetrl's default) and
    spinning first (GNU OpenMP's), alternating run by run so that both see the same machine."""
    ways = {"sleeping": {}, "spinning": SPINNING}
    results: dict[str, list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for way, env in ways.items():
                results[way].append(run(1, args, Path(tmp), label=f"-{way}-{i}", env=env))
                r = results[way][-1]
                print(f"{way} #{i + 1}: last step done {r['last_step_s']:.1f} s after launch, step 1's training "
                      f"{r['first_train_s']:.1f} s, step 2's rollouts {r['second_rollout_s']:.1f} s", flush=True)
    for key, label in [("last_step_s", f"launch to the end of step {args.steps}"),
                       ("first_train_s", "step 1's training"), ("second_rollout_s", "step 2's rollouts")]:
        means = {way: statistics.mean(r[key] for r in rs) for way, rs in results.items()}
        spread = {way: f"{min(r[key] for r in rs):.1f}-{max(r[key] for r in rs):.1f}" for way, rs in results.items()}
        detail = (f"mean {means['sleeping']:.1f} s (range {spread['sleeping']}) vs {means['spinning']:.1f} s "
                  f"(range {spread['spinning']}), {args.repeats} runs each")
        print(f"{label}, sleeping / spinning: {means['sleeping'] / means['spinning']:.2f} ({detail})")
        record(f"{label}, OpenMP threads sleeping / spinning", means["sleeping"] / means["spinning"], detail)


def example_commands(root: Path) -> dict[str, list[str]]:
    """docs/examples.md's base evaluation and warm start (1 step), writing under `root`."""
    fleetrl = [sys.executable, "-m", "fleetrl"]
    return {"eval": [*fleetrl, "eval", "@", "examples/math/rl.toml", "--out", str(root / "eval")],
            "sft": [*fleetrl, "sft", "@", "examples/math/sft.toml", "--run.dir", str(root / "sft"),
                    "--run.max_steps", "1"]}


def timed(commands: dict[str, list[str]], env: dict[str, str], together: bool) -> dict[str, float]:
    """Each command's wall time from the first's launch, run side by side (`together`) or one after
    the other; the pair's (the later end); the evaluation's own ("evaluated v0 in S s") and the
    training step's ("train S s"). Output goes to files: a pipe read after the other command's
    end could fill and stall its writer."""
    started, procs, times, out = time.time(), {}, {}, {}
    for name, cmd in commands.items():
        log = tempfile.TemporaryFile("w+")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}), log)
        if not together:
            procs[name][0].wait()
            times[name] = time.time() - started
    while len(times) < len(procs):  # each command's end as it comes, whichever comes first
        for name, (proc, _) in procs.items():
            if name not in times and proc.poll() is not None:
                times[name] = time.time() - started
        time.sleep(0.1)
    for name, (proc, log) in procs.items():
        log.seek(0)
        out[name] = log.read()
        log.close()
        if proc.returncode != 0:
            raise SystemExit(f"bench_rl: {' '.join(commands[name])} failed ({proc.returncode}):\n{out[name][-2000:]}")
    times["the pair"] = max(times["eval"], times["sft"])
    times["evaluation"] = float(re.search(r"evaluated v0 in ([\d.]+) s", out["eval"])[1])
    times["training step"] = float(re.search(r"train ([\d.]+)s", out["sft"])[1])
    return times


def eval_beside_sft(args) -> None:
    """The worked example's base evaluation beside its warm start, OpenMP threads sleeping and
    spinning, alternating; then the two one after the other."""
    ways = {"sleeping": {}, "spinning": SPINNING}
    results: dict[str, list[dict]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for way, env in ways.items():
                results[way].append(timed(example_commands(Path(tmp) / f"{way}-{i}"), env, together=True))
                print(f"{way} #{i + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in results[way][-1].items()), flush=True)
        alone = timed(example_commands(Path(tmp) / "one-after-the-other"), {}, together=False)
    print("one after the other (sleeping): " + ", ".join(f"{k} {v:.1f} s" for k, v in alone.items()))
    for key in ("the pair", "eval", "sft", "evaluation", "training step"):
        means = {way: statistics.mean(r[key] for r in rs) for way, rs in results.items()}
        detail = (f"mean {means['sleeping']:.1f} s vs {means['spinning']:.1f} s side by side, {args.repeats} runs "
                  f"each; {alone[key]:.1f} s one after the other")
        print(f"{key}, sleeping / spinning: {means['sleeping'] / means['spinning']:.2f} ({detail})")
        record(f"the worked example's eval beside its sft: {key}, OpenMP threads sleeping / spinning",
               means["sleeping"] / means["spinning"], detail)


def fenced_against_rolling(args) -> None:
    """The same sampling-bound job, each publish fenced (every worker paused together) and rolling
    (a wave of one worker at a time, the trainer waiting for the canary only), back to back."""
    flags = ("--orchestrator.max_tokens", str(args.max_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        results = {kind: run(1, args, Path(tmp), workers=2, flags=(*flags, "--inference.publish", kind), label=kind)
                   for kind in ("fenced", "rolling")}
        for r in results.values():
            r.update(sampling_throughput(r["run_dir"], args.window_s))
    for kind, r in results.items():
        kl = max(r["mismatch_kl"])
        print(f"{kind}: {describe(r)}\n  sampling throughput {r['steady_tps']:.0f} tokens/s without a publish; "
              f"windows of {args.window_s:g} s with a fence {r['publish_fraction']:.2f} of it "
              f"({r['publish_windows']} of {r['windows']} windows), during the fences {r['fence_fraction']:.2f}; "
              f"mismatch_kl at most {kl:.2e} over {len(r['mismatch_kl'])} steps"
              + ("" if kl <= 1e-6 else " (ABOVE 1e-6)"))
    fenced, rolling = results["fenced"], results["rolling"]
    for label, ratio, detail in [
        (f"sampling throughput in {args.window_s:g} s windows with a publish / without, fenced",
         fenced["publish_fraction"], f"during the fences {fenced['fence_fraction']:.2f}"),
        (f"sampling throughput in {args.window_s:g} s windows with a publish / without, rolling",
         rolling["publish_fraction"], f"during the fences {rolling['fence_fraction']:.2f}"),
        ("step time, rolling / fenced publishes (2 workers, k = 1)", rolling["step_s"] / fenced["step_s"],
         f"{rolling['step_s']:.1f} vs {fenced['step_s']:.1f} s/step, {args.steps} steps, "
         f"max_tokens {args.max_tokens}"),
    ]:
        print(f"{label}: {ratio:.2f} ({detail})")
        record(label, ratio, detail)


def sampling_throughput(run_dir: Path, window_s: float) -> dict:
    """Tokens/s over all workers while sampling had work, in the windows of `window_s` that hold
    a fence, as a fraction of those that hold none, and during the fences themselves; from the
    first fence of v1 to the last sample's end (the start-up and the run's last publish, after
    every rollout, left out).

    From events.jsonl: a sample's tokens are spread evenly over its time on its worker less the
    time that worker was fenced (a paused worker makes no token: the keep and abort pauses), and
    a window's rate divides its tokens by the time in it when at least one sample was waiting for
    tokens. The time when no sample was (the k bound holding sampling back while the trainer
    trains) says nothing about a publish, so it counts in neither side."""
    events = RunDir(run_dir).read_events()
    samples = [e for e in events if isinstance(e, SampleEvent) and e.end > e.start]
    fences, opened = [], {}  # (start, end, the workers fenced: None for all)
    for e in (e for e in events if isinstance(e, FenceEvent) and e.version >= 1):
        key = (e.version, e.wave)
        if e.phase == "start":
            opened[key] = (e.t, None if e.workers is None else set(e.workers))
        elif key in opened:
            began, workers = opened.pop(key)
            fences.append((began, e.t, workers))
    # Each sample's time on its worker while that worker was not fenced, and its tokens per second of it.
    active = []
    for s in samples:
        spans = _minus((s.start, s.end), [(a, b) for a, b, ws in fences if ws is None or s.worker in ws])
        if (length := _length(spans)) > 0:
            active.append((spans, s.tokens / length))
    waiting = _union([(s.start, s.end) for s in samples])

    def tokens_in(a: float, b: float) -> float:
        return sum(per_s * _overlap(spans, a, b) for spans, per_s in active)

    def rate(spans: list[tuple[float, float]]) -> float:
        busy = sum(_overlap(waiting, a, b) for a, b in spans)
        return sum(tokens_in(a, b) for a, b in spans) / busy if busy else float("nan")

    begin, end = min(a for a, _, _ in fences), max(s.end for s in samples)
    windows = [(a, a + window_s) for a in _steps(begin, end - window_s, window_s)]
    with_fence = [w for w in windows if any(a < w[1] and b > w[0] for a, b, _ in fences)]
    without = [w for w in windows if w not in with_fence]
    if not with_fence or not without:
        raise SystemExit(f"bench_rl: of {len(windows)} windows of {window_s:g} s in {run_dir}, {len(with_fence)} "
                         "hold a fence: change --window-s or --steps so that some do and some do not")
    steady = rate(without)
    return {"steady_tps": steady, "publish_fraction": rate(with_fence) / steady,
            "fence_fraction": rate([(a, b) for a, b, _ in fences if b <= end]) / steady,
            "windows": len(windows), "publish_windows": len(with_fence)}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _minus(span: tuple[float, float], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`span` less every hole in it."""
    left, (a, b) = [], span
    for h0, h1 in _union(holes):
        if h0 > a:
            left.append((a, min(b, h0)))
        a = max(a, h1)
        if a >= b:
            break
    return left + ([(a, b)] if a < b else [])


def _overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(y - x for x, y in spans)


def _steps(start: float, stop: float, step: float):
    while start <= stop:
        yield start
        start += step


def memory_growth(args) -> None:
    """Peak memory of the trainer and of each worker against batch size and worker count."""
    with open("configs/default.toml", "rb") as f:
        batch = args.batch_prompts or tomllib.load(f)["orchestrator"]["batch_prompts"]
    cases = {"as configured": (batch, args.workers), "twice the batch": (2 * batch, args.workers),
             "one worker more": (batch, args.workers + 1)}
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(1, args, Path(tmp), b, w) for name, (b, w) in cases.items()}
    for name, r in results.items():
        b, w = cases[name]
        print(f"{name} ({b} prompts per batch, {w} worker(s)): " + describe(r))
    base, batch2, more = (results[name] for name in cases)
    per_worker = lambda r: max(r["worker_peak_gib"])  # noqa: E731
    for label, ratio, detail in [
        ("peak RSS trainer, twice the batch / as configured", batch2["trainer_peak_gib"] / base["trainer_peak_gib"],
         f"{batch2['trainer_peak_gib']:.2f} vs {base['trainer_peak_gib']:.2f} GiB"),
        ("peak RSS per worker, twice the batch / as configured", per_worker(batch2) / per_worker(base),
         f"{per_worker(batch2):.2f} vs {per_worker(base):.2f} GiB"),
        (f"peak RSS trainer, {args.workers + 1} workers / {args.workers}", more["trainer_peak_gib"] / base["trainer_peak_gib"],
         f"{more['trainer_peak_gib']:.2f} vs {base['trainer_peak_gib']:.2f} GiB"),
        (f"peak RSS per worker, {args.workers + 1} workers / {args.workers}", per_worker(more) / per_worker(base),
         f"{per_worker(more):.2f} vs {per_worker(base):.2f} GiB"),
    ]:
        print(f"{label}: {ratio:.2f} ({detail})")
        record(label, ratio, detail)


if __name__ == "__main__":
    main()
