"""Dynamo provider vs native provider, measured side by side in one run and reported as ratios.

    .venv/bin/python benchmarks/bench_dynamo.py [--reps 3] [--max-tokens 32]

Both fleets run at once on the same machine, one worker each (a Dynamo frontend + one of
Dynamo's vLLM workers; one native vLLM server), same model, dtype and limits, and the
measurements alternate between them so machine load hits both alike:

1. rollout throughput: completion tokens/s at 16 and 64 concurrent requests through the
   fleet (Dynamo: through the frontend, pinned to the worker; native: straight to the server);
2. publish: one policy version by the broadcast transport through Dynamo's RL admin routes
   vs through vLLM's weight-transfer routes.

Results go to docs/benchmarks.md with the command line that produced them.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import tempfile
from pathlib import Path

import torch
from bench_fleet import BUCKET_BYTES, interleaved_publishes, median_time, tokens_per_s_fleet

from fleetrl.config import InferenceConfig, ModelConfig
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.vllm.provider import VllmProvider
from fleetrl.model import resolve_model
from fleetrl.weights.transport import make_transport


async def main(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(ModelConfig())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        native = Fleet(VllmProvider(InferenceConfig(workers=1, max_model_len=512), model_dir, tmp / "native",
                                    secrets.token_urlsafe(16)), discovery_interval_s=3600)
        dynamo = Fleet(DynamoProvider(InferenceConfig(provider="dynamo", workers=1, max_model_len=512),
                                      model_dir, tmp / "dynamo"), pause_mode="wait", discovery_interval_s=3600)
        fleets = {"dynamo": dynamo, "native": native}
        try:
            for fleet in fleets.values():
                await fleet.start()
            print(f"\n# fleetrl: Dynamo provider vs native provider, 1 worker each, SmolLM2-135M fp32, "
                  f"{args.reps} reps\n")
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
            for concurrency in (16, 64):
                prompts = [prompt] * (concurrency * 2)
                rates: dict[str, list[float]] = {name: [] for name in fleets}
                for _ in range(args.reps):  # alternate the two fleets
                    for name, fleet in fleets.items():
                        rates[name].append(await tokens_per_s_fleet(fleet, prompts, concurrency, args.max_tokens))
                d, n = statistics.median(rates["dynamo"]), statistics.median(rates["native"])
                print(f"rollouts at {concurrency} concurrent: Dynamo frontend {d:.0f} tok/s, native {n:.0f} tok/s, "
                      f"ratio Dynamo / native {d / n:.2f}")
            times = await interleaved_publishes(
                {name: (fleet, make_transport("broadcast", host="127.0.0.1", bucket_bytes=BUCKET_BYTES,
                                              storage_dir=tmp / name)) for name, fleet in fleets.items()},
                model, args.reps)
            d, n = statistics.median(times["dynamo"]), statistics.median(times["native"])
            print(f"\npublish by broadcast through Dynamo's admin routes: {median_time(times['dynamo'])}")
            print(f"publish by broadcast through vLLM's routes (native): {median_time(times['native'])}")
            print(f"  ratio Dynamo / native: {d / n:.2f}")
        finally:
            for fleet in fleets.values():
                await fleet.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    asyncio.run(main(parser.parse_args()))
