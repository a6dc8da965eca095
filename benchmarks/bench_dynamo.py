"""Two fleets measured side by side in one run, reported as ratios:

    .venv/bin/python benchmarks/bench_dynamo.py [--compare native|worker-kind] [--reps 3] [--max-tokens 32]

- `native` (default): the Dynamo provider (a frontend + one of Dynamo's vLLM workers) vs the
  native provider (one vLLM server);
- `worker-kind`: fleetrl's Dynamo worker kind (per-token versions, keep-mode pauses) vs
  Dynamo's own worker (sequence-level versions, wait-mode pauses), each behind its own frontend.

Both fleets run at once on the same machine, one worker each, same model, dtype and limits,
and the measurements alternate between them so machine load hits both alike:

1. rollout throughput: completion tokens/s at 16 and 64 concurrent requests through the
   fleet (Dynamo: through the frontend, pinned to the worker; native: straight to the server);
2. publish: one policy version by the broadcast transport.

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
from bench_report import record

from fleetrl.config import DynamoConfig, InferenceConfig, ModelConfig, VllmConfig
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.vllm.provider import VllmProvider
from fleetrl.model import resolve_model
from fleetrl.versions import new_run_id
from fleetrl.weights.factory import make_transport


async def main(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(ModelConfig())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fleets = compared_fleets(args.compare, model_dir, tmp)
        (a, b) = fleets
        try:
            for fleet in fleets.values():
                await fleet.start()
            print(f"\n# fleetrl: {a} vs {b}, 1 worker each, SmolLM2-135M fp32, {args.reps} reps\n")
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
            for concurrency in (16, 64):
                prompts = [prompt] * (concurrency * 2)
                rates: dict[str, list[float]] = {name: [] for name in fleets}
                for _ in range(args.reps):  # alternate the two fleets
                    for name, fleet in fleets.items():
                        rates[name].append(await tokens_per_s_fleet(fleet, prompts, concurrency, args.max_tokens))
                ra, rb = statistics.median(rates[a]), statistics.median(rates[b])
                print(f"rollouts at {concurrency} concurrent: {a} {ra:.0f} tok/s, {b} {rb:.0f} tok/s, "
                      f"ratio {a} / {b} {ra / rb:.2f}")
                record(f"rollout tokens/s, {a} / {b}, {concurrency} concurrent", ra / rb, f"{ra:.0f} vs {rb:.0f} tok/s")
            times = await interleaved_publishes(
                {name: (fleet, make_transport("broadcast", host="127.0.0.1", bucket_bytes=BUCKET_BYTES,
                                              storage_dir=tmp / name)) for name, fleet in fleets.items()},
                model, args.reps)
            ta, tb = statistics.median(times[a]), statistics.median(times[b])
            print(f"\npublish by broadcast, {a}: {median_time(times[a])}")
            print(f"publish by broadcast, {b}: {median_time(times[b])}")
            print(f"  ratio {a} / {b}: {ta / tb:.2f}")
            record(f"broadcast publish time, {a} / {b}", ta / tb, f"{ta:.2f} s vs {tb:.2f} s")
        finally:
            for fleet in fleets.values():
                await fleet.close()


def compared_fleets(compare: str, model_dir: Path, tmp: Path) -> dict[str, Fleet]:
    def dynamo(name: str, **fields) -> Fleet:
        config = InferenceConfig(provider="dynamo", workers=1, vllm=VllmConfig(max_model_len=512), **fields)
        provider = DynamoProvider(config, model_dir, tmp / name, new_run_id())
        return Fleet(provider, pause_mode=config.resolved_pause_mode(), discovery_interval_s=3600)

    if compare == "worker-kind":
        return {"fleetrl kind": dynamo("fleetrl-kind", dynamo=DynamoConfig(worker="fleetrl")),
                "Dynamo kind": dynamo("dynamo-kind")}
    native = VllmProvider(InferenceConfig(workers=1, vllm=VllmConfig(max_model_len=512)), model_dir,
                          tmp / "native", secrets.token_urlsafe(16), secrets.token_urlsafe(16), new_run_id())
    return {"Dynamo": dynamo("dynamo"), "native": Fleet(native, discovery_interval_s=3600)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=["native", "worker-kind"], default="native")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    asyncio.run(main(parser.parse_args()))
