"""How long a launched vLLM CPU server takes to serve, five ways, side by side in one run: vLLM's
default on CPUs (the model runner in a worker process of its own), the model runner in the
engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) spawned as vLLM spawns it, that engine core
forked from the server (fleetrl's launcher, engine/engine_core_fork.py), the same with
torch.compile left on (without the launcher's TORCHDYNAMO_DISABLE=1): vLLM then compiles its
sampler's logprob helper with inductor at the first request, and the same with Python's garbage
collector running while the server imports vLLM (fleetrl/heavy_imports.py pauses it).

    .venv/bin/python benchmarks/bench_engine_start.py [--reps 3]

Each repetition starts one server of each kind in turn, with fleetrl's launcher's command line
and environment (as `fleetrl rl` starts a worker), and times it from the start to its first
/health answer, then its first completion with logprobs (as every rollout asks). It counts the server's processes and their memory, and checks that a greedy
completion's logprobs are the same in all five. Why it matters: each of a server's interpreters
imports vLLM, one after another, and the test suite starts about 28 engines (issue 38). Results
go to docs/benchmarks.md with the command line that produced them.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench_report import record

from fleetrl.config import InferenceConfig, ModelConfig
from fleetrl.contract import NATIVE_SERVER_MODULE
from fleetrl.inference.vllm.launcher import LaunchedServer, server_argv, server_env, wait_healthy
from fleetrl.model import resolve_model
from fleetrl.processes import free_port, start_process

# Each kind: what runs the server (in place of the launcher's `-m` and module) and what it
# changes in the launcher's environment (None: unset). vLLM's CPU platform runs the model in a
# worker process of its own unless the engine is told it runs in one process; vLLM's own module
# spawns the engine core, fleetrl's forks it.
VLLM_SERVER = ("-m", "vllm.entrypoints.openai.api_server")
FLEETRL_SERVER = ("-m", NATIVE_SERVER_MODULE)
# fleetrl's server with `imports_without_gc` undone: no pause, no collection after, no freeze.
COLLECTING_SERVER = ("-c", "import contextlib; from fleetrl.engine import serve; "
                           "serve.imports_without_gc = contextlib.nullcontext; serve.main()")
FORKED = "engine core, forked"
COMPILING = "engine core, forked, compiling"
COLLECTING = "engine core, forked, collector on while importing"
KINDS = {"worker process": (VLLM_SERVER, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
         "engine core, spawned": (VLLM_SERVER, {}),
         FORKED: (FLEETRL_SERVER, {}),
         COMPILING: (FLEETRL_SERVER, {"TORCHDYNAMO_DISABLE": None}),
         COLLECTING: (COLLECTING_SERVER, {})}
PROMPT = "The capital of France is"


async def start_once(model_dir: Path, config: InferenceConfig, log_dir: Path, kind: str):
    """One server of one kind: seconds to /health, its process count, their memory (GiB), a
    greedy completion's logprobs and the seconds it took; stopped before it returns."""
    server, changes = KINDS[kind]
    admin, data = secrets.token_hex(16), secrets.token_hex(16)
    port = free_port(config.host)
    argv = server_argv(model_dir, config, port)
    at = argv.index(NATIVE_SERVER_MODULE) - 1  # its "-m"
    argv[at:at + 2] = server
    env = {**server_env(config, 0, port, admin, data), **changes}
    env = {name: value for name, value in env.items() if value is not None}
    name = "bench-" + kind.replace(", ", "-").replace(" ", "-")
    started = time.monotonic()
    process = start_process(name, argv, log_dir / f"{name}.log", env=env, cpus=config.vllm.engine_cpus(0))
    try:
        url = f"http://{config.host}:{port}"
        await wait_healthy([LaunchedServer("bench", url, process, 0)], config.startup_timeout_s, log=lambda *_: None)
        seconds = time.monotonic() - started
        tree = [psutil.Process(process.popen.pid), *psutil.Process(process.popen.pid).children(recursive=True)]
        rss_gib = sum(p.memory_info().rss for p in tree) / 2**30
        asked = time.monotonic()
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {data}"},
                                       json={"model": "policy", "prompt": PROMPT, "max_tokens": 8,
                                             "temperature": 0, "logprobs": 0})
            answer.raise_for_status()
        first_answer_s = time.monotonic() - asked
        logprobs = answer.json()["choices"][0]["logprobs"]["token_logprobs"]
        return seconds, len(tree), rss_gib, logprobs, first_answer_s
    finally:
        process.stop()


async def main(reps: int) -> None:
    model_dir = resolve_model(ModelConfig())
    config = InferenceConfig()
    results: dict[str, list] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for kind in KINDS:  # interleaved: a drift of the machine hits each
                results[kind].append(await start_once(model_dir, config, Path(tmp), kind))
                seconds, processes, rss, _, first = results[kind][-1]
                print(f"rep {rep + 1}/{reps}: {kind}: serving after {seconds:.1f} s, {processes} processes, "
                      f"{rss:.2f} GiB, first completion in {first:.2f} s", flush=True)
    logprobs = [rows[0][3] for rows in results.values()]
    gap = max(abs(a - b) for other in logprobs[1:] for a, b in zip(logprobs[0], other))
    print(f"\ngreedy logprobs of {len(logprobs[0])} tokens: largest difference between the kinds {gap:.2e}")
    medians = {kind: statistics.median(r[0] for r in rows) for kind, rows in results.items()}
    for kind, rows in results.items():
        print(f"{kind}: median {medians[kind]:.1f} s to serve (min {min(r[0] for r in rows):.1f}, max "
              f"{max(r[0] for r in rows):.1f}), {rows[0][1]} processes, {statistics.median(r[2] for r in rows):.2f} GiB, "
              f"first completion {statistics.median(r[4] for r in rows):.2f} s")
    for baseline in ("worker process", "engine core, spawned"):
        ratio = medians[FORKED] / medians[baseline]
        print(f"{FORKED} / {baseline}: {ratio:.2f}x the time to serve")
        record(f"engine start, engine core forked / {baseline}", ratio, f"{reps} reps, logprob gap {gap:.1e}")
    first = {kind: statistics.median(r[4] for r in results[kind]) for kind in (FORKED, COMPILING)}
    print(f"{FORKED} / {COMPILING}: {first[FORKED] / first[COMPILING]:.2f}x the time of the first completion")
    record("engine first completion, torch.compile off / on", first[FORKED] / first[COMPILING],
           f"{reps} reps, logprob gap {gap:.1e}")
    ratio = medians[FORKED] / medians[COLLECTING]
    print(f"{FORKED} / {COLLECTING}: {ratio:.2f}x the time to serve")
    record("engine start, imports without / with the garbage collector", ratio, f"{reps} reps, logprob gap {gap:.1e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    asyncio.run(main(parser.parse_args().reps))
