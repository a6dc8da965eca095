"""How long a launched vLLM CPU server takes to serve, with its model runner in a worker process
of its own (vLLM's default on CPUs) against in the engine-core process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), measured side by side in one run.

    .venv/bin/python benchmarks/bench_engine_start.py [--reps 3]

Each repetition starts one server of each kind in turn, through fleetrl's own launcher (as
`fleetrl rl` starts a worker), and times it from the start to its first /health answer. It counts
the server's processes and their memory, and checks that a greedy completion's logprobs are the
same in both. Why it matters: each of a server's interpreters imports vLLM, one after another,
and the test suite starts about 28 engines (issue 38). Results go to docs/benchmarks.md with the
command line that produced them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench_report import record

from fleetrl.config import InferenceConfig, ModelConfig
from fleetrl.inference.vllm.launcher import LaunchedServer, start_server, wait_healthy
from fleetrl.model import resolve_model
from fleetrl.processes import free_port

# What each kind sets in the server's environment: vLLM's CPU platform runs the model in a worker
# process of its own unless the engine is told it runs in one process.
KINDS = {"worker process": "1", "in the engine core": "0"}
PROMPT = "The capital of France is"


async def start_once(model_dir: Path, config: InferenceConfig, log_dir: Path, multiprocessing: str):
    """One server of one kind: seconds to /health, its process count, their memory (GiB), and a
    greedy completion's logprobs; stopped before it returns."""
    admin, data = secrets.token_hex(16), secrets.token_hex(16)
    port = free_port(config.host)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing  # the launched server inherits it
    started = time.monotonic()
    process = start_server(model_dir, config, f"bench-{multiprocessing}", 0, port, log_dir, admin, data)
    try:
        url = f"http://{config.host}:{port}"
        await wait_healthy([LaunchedServer("bench", url, process, 0)], config.startup_timeout_s, log=lambda *_: None)
        seconds = time.monotonic() - started
        tree = [psutil.Process(process.popen.pid), *psutil.Process(process.popen.pid).children(recursive=True)]
        rss_gib = sum(p.memory_info().rss for p in tree) / 2**30
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {data}"},
                                       json={"model": "policy", "prompt": PROMPT, "max_tokens": 8,
                                             "temperature": 0, "logprobs": 0})
            answer.raise_for_status()
        logprobs = answer.json()["choices"][0]["logprobs"]["token_logprobs"]
        return seconds, len(tree), rss_gib, logprobs
    finally:
        process.stop()
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)


async def main(reps: int) -> None:
    model_dir = resolve_model(ModelConfig())
    config = InferenceConfig()
    results: dict[str, list] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for kind, multiprocessing in KINDS.items():  # interleaved: a drift of the machine hits both
                results[kind].append(await start_once(model_dir, config, Path(tmp), multiprocessing))
                seconds, processes, rss, _ = results[kind][-1]
                print(f"rep {rep + 1}/{reps}: {kind}: serving after {seconds:.1f} s, {processes} processes, "
                      f"{rss:.2f} GiB", flush=True)
    (_, _, _, separate), (_, _, _, in_core) = results["worker process"][0], results["in the engine core"][0]
    gap = max(abs(a - b) for a, b in zip(separate, in_core))
    print(f"\ngreedy logprobs of {len(separate)} tokens: largest difference between the kinds {gap:.2e}")
    medians = {kind: statistics.median(r[0] for r in rows) for kind, rows in results.items()}
    for kind, rows in results.items():
        print(f"{kind}: median {medians[kind]:.1f} s to serve (min {min(r[0] for r in rows):.1f}, max "
              f"{max(r[0] for r in rows):.1f}), {rows[0][1]} processes, {statistics.median(r[2] for r in rows):.2f} GiB")
    ratio = medians["in the engine core"] / medians["worker process"]
    print(f"in the engine core / worker process: {ratio:.2f}x the time to serve")
    record("engine start, in the engine core / worker process", ratio, f"{reps} reps, logprob gap {gap:.1e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    asyncio.run(main(parser.parse_args().reps))
