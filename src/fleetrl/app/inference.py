"""`fleetrl inference`: start the fleet, sample a few completions, print them, shut down."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fleetrl.app.providers import base_weights, build_fleet, build_transport
from fleetrl.config import Config
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import GenerateRequest, SamplingParams
from fleetrl.model import resolve_model
from fleetrl.orchestrator.chat import render_prompt
from fleetrl.rundir import RunDir
from fleetrl.versions import version_name

DEFAULT_PROMPTS = ["Name three primary colors.", "What is 7 + 5?", "Write the word 'fleet' backwards."]


async def run_inference(config: Config, prompts: list[str]) -> int:
    # The run directory holds the workers' logs and the weights' storage: a live run's directory
    # (the default one of `make run`, say) is that run's alone, and this command is refused there.
    run_dir = RunDir(config.run.dir)
    model_dir = resolve_model(config.model)
    fleet = build_fleet(config, run_dir, model_dir)  # bad input is refused here, before the directory is touched
    run_dir.lock()
    try:
        return await _sample(config, prompts, fleet, model_dir, run_dir)
    finally:
        run_dir.close()


async def _sample(config: Config, prompts: list[str], fleet: Fleet, model_dir: Path, run_dir: RunDir) -> int:
    from transformers import AutoTokenizer

    transport = build_transport(config, run_dir)
    try:
        # Attached workers are labelled v0 only once they hold the base weights.
        weights = base_weights(fleet.provider, model_dir, transport)
        await fleet.start(weights)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        sampling = SamplingParams(
            temperature=config.orchestrator.temperature,
            max_tokens=config.orchestrator.max_tokens,
            stop_token_ids=(tokenizer.eos_token_id,),
            seed=config.run.seed,
        )
        requests = [
            GenerateRequest(
                prompt_token_ids=render_prompt(tokenizer, [{"role": "user", "content": p}]),
                sampling=sampling,
            )
            for p in prompts
        ]
        results = await asyncio.gather(*(fleet.generate(r) for r in requests))
        for prompt, (completion,) in zip(prompts, results):
            spans = ", ".join(f"{version_name(s.version)}@{s.start}" for s in completion.spans)
            text = tokenizer.decode(completion.token_ids, skip_special_tokens=True).strip()
            print(f"\n> {prompt}\n{text}\n  [{len(completion.token_ids)} tokens, worker {completion.worker_id}, "
                  f"versions {spans}, finish {completion.finish_reason}]")
    finally:
        await transport.close()
        await fleet.close()
    return 0
