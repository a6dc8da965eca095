"""One trainer step of fleetrl against a bare transformers + torch step on the same batch, and
fleetrl's step on 2 ranks against 1.

    .venv/bin/python benchmarks/bench_trainer.py [--reps 3] [--prompts 8] [--group 4]
        [--prompt-tokens 128] [--completion-tokens 8] [--micro-batch-tokens 1024] [--threads N]
        [--batch RUN_DIR/batches/step_N.json]

Both steps take the same batch (the embedded model, `--prompts` x `--group` samples with random
token ids at the given lengths: the shape of `make run`'s reverse_text batches, a prompt of
about 128 tokens shared by the group and a few completion tokens; or, with --batch, a batch a
run wrote), the same micro-batch budget (rows x padded length), fp32, AdamW, gradient clipping,
and the same number of threads. The bare step is what a user would write with transformers
alone: a plain forward over each right-padded micro-batch of samples (all logits), log-softmax,
the policy-gradient loss, backward, clip, step. fleetrl's is `trainer.step.train_step` (each
group's prompt once in its row, the PPO-clipped, importance-corrected loss and its statistics). They run alternately, `--reps` times each after one warm-up step, and the ratio
of their median tokens/s is the figure (prompt + completion tokens per second of step time).

The 2-rank figure runs fleetrl's step in 2 processes (FSDP2 over gloo, half the threads each)
against 1 process with all of them, on the same batch.

The LoRA figure runs fleetrl's step with a rank-16 adapter on every linear layer (configs/
lora.toml) against full fine-tuning, each in a process of its own on the same batch and threads,
alternately `--reps` times (peak memory with LoRA: benchmarks/bench_rl.py --lora, which samples
every process of a run).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench_report import record
from fleetrl.batch import Batch, Sample
from fleetrl.config import ModelConfig
from fleetrl.model import resolve_model
from fleetrl.trainer import distributed
from fleetrl.trainer.model import load_policy
from fleetrl.trainer.schedule import Schedule
from fleetrl.trainer.step import PAD_ID, StepConfig, build_optimizer, train_step
from fleetrl.versions import VersionSpan


def synthetic_batch(vocab: int, args) -> Batch:
    rng = random.Random(0)
    samples = []
    for group in range(args.prompts):
        prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_tokens + rng.randint(-8, 8))]
        for i in range(args.group):
            completion = [rng.randrange(1, vocab) for _ in range(rng.randint(args.completion_tokens // 2,
                                                                            args.completion_tokens))]
            samples.append(Sample(prompt, completion, [-3.0] * len(completion), [VersionSpan(0, 0)],
                                  reward=float(i % 2), advantage=1.0 if i % 2 else -1.0, group=group))
    return Batch(step=1, samples=samples)


def tokens_of(batch: Batch) -> int:
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.samples)


def padded_micro_batches(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Samples longest first, in runs whose rows x padded length fit `max_tokens`."""
    ordered = sorted(samples, key=lambda s: -(len(s.prompt_ids) + len(s.completion_ids)))
    out: list[list[Sample]] = []
    for s in ordered:
        if out and (len(out[-1]) + 1) * (len(out[-1][0].prompt_ids) + len(out[-1][0].completion_ids)) <= max_tokens:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def bare_step(model, optimizer, batch: Batch, cfg: StepConfig) -> None:
    """The step a user writes with transformers alone, under the same micro-batch budget."""
    completion_tokens = sum(len(s.completion_ids) for s in batch.samples)
    model.train()
    for micro in padded_micro_batches(batch.samples, cfg.micro_batch_tokens):
        length = max(len(s.prompt_ids) + len(s.completion_ids) for s in micro)
        ids = torch.full((len(micro), length), PAD_ID, dtype=torch.long)
        mask = torch.zeros(len(micro), length - 1)
        for row, s in enumerate(micro):
            seq = s.prompt_ids + s.completion_ids
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, len(s.prompt_ids) - 1: len(seq) - 1] = 1
        logprobs = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
        picked = logprobs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        advantages = torch.tensor([s.advantage for s in micro]).unsqueeze(1)
        loss = -(advantages * picked * mask).sum() / completion_tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(step) -> float:
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def side_by_side(model_dir: Path, batch: Batch, cfg: StepConfig, reps: int) -> dict[str, float]:
    """Median tokens/s of each step, run alternately on two copies of the model."""
    models = {name: load_policy(model_dir, torch.device("cpu")) for name in ("fleetrl", "bare")}
    optimizers = {name: build_optimizer(m, cfg) for name, m in models.items()}
    steps = {
        "fleetrl": lambda: train_step(models["fleetrl"], optimizers["fleetrl"], batch, cfg),
        "bare": lambda: bare_step(models["bare"], optimizers["bare"], batch, cfg),
    }
    for step in steps.values():  # warm-up: allocator, kernels, optimizer state
        step()
    seconds = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            seconds[name].append(timed(step))
    return {name: tokens_of(batch) / statistics.median(s) for name, s in seconds.items()}


def _rank(rank: int, world: int, port: int, model_dir: Path, batch: Batch, cfg: StepConfig, reps: int,
          threads: int, out: Path, adapter: dict | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    distributed.init(timeout_s=600)
    try:
        model = load_policy(model_dir, torch.device("cpu"), adapter=adapter)
        optimizer = build_optimizer(model, cfg)
        train_step(model, optimizer, batch, cfg)  # warm-up
        seconds = [timed(lambda: train_step(model, optimizer, batch, cfg)) for _ in range(reps)]
        if rank == 0:
            out.write_text(str(statistics.median(seconds)))
    finally:
        distributed.destroy()


def fleetrl_on(world: int, threads: int, model_dir: Path, batch: Batch, cfg: StepConfig, reps: int,
               adapter: dict | None = None) -> float:
    """Median tokens/s of fleetrl's step on `world` ranks (processes) of `threads` threads each;
    `adapter`: a LoRA adapter's config (trainer/lora.py)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "seconds"
        mp.start_processes(_rank, args=(world, port, model_dir, batch, cfg, reps, threads, out, adapter),
                           nprocs=world, start_method="spawn")
        return tokens_of(batch) / float(out.read_text())


def lora_against_full(model_dir: Path, batch: Batch, cfg: StepConfig, args) -> None:
    """configs/lora.toml's adapter against full fine-tuning: a process each, alternately."""
    from fleetrl.config import LoraConfig
    from fleetrl.trainer.lora import adapter_config

    adapter = adapter_config(LoraConfig(rank=16, alpha=32), model_dir)
    runs: dict[str, list[float]] = {"lora": [], "full": []}
    for _ in range(args.reps):
        for name in runs:
            runs[name].append(fleetrl_on(1, args.threads, model_dir, batch, cfg, 1, adapter if name == "lora" else None))
    rate = {name: statistics.median(results) for name, results in runs.items()}
    print(f"fleetrl train_step with a rank-16 LoRA adapter: {rate['lora']:.0f} tokens/s; full fine-tuning: "
          f"{rate['full']:.0f} tokens/s; ratio {rate['lora'] / rate['full']:.2f}")
    record("trainer step, LoRA rank 16 / full fine-tuning (tokens/s)", rate["lora"] / rate["full"],
           f"{rate['lora']:.0f} vs {rate['full']:.0f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--batch", type=Path, default=None,
                        help="a batch file a run wrote (RUN_DIR/batches/step_N.json) instead of the synthetic batch")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(ModelConfig())
    from transformers import AutoConfig

    batch = (Batch.from_json(args.batch.read_text()) if args.batch
             else synthetic_batch(AutoConfig.from_pretrained(model_dir).vocab_size, args))
    cfg = StepConfig(schedule=Schedule(lr=2e-5), micro_batch_tokens=args.micro_batch_tokens)
    print(f"batch: {len(batch.samples)} samples, {tokens_of(batch)} tokens; micro-batches of <= "
          f"{cfg.micro_batch_tokens} tokens; {args.threads} thread(s); {args.reps} rep(s) after a warm-up")
    rates = side_by_side(model_dir, batch, cfg, args.reps)
    ratio = rates["fleetrl"] / rates["bare"]
    print(f"fleetrl train_step: {rates['fleetrl']:.0f} tokens/s; bare transformers + torch step: "
          f"{rates['bare']:.0f} tokens/s; ratio {ratio:.2f}")
    record("trainer step, fleetrl / bare transformers (tokens/s)", ratio,
           f"{rates['fleetrl']:.0f} vs {rates['bare']:.0f} tokens/s, {tokens_of(batch)} tokens, {args.threads} threads")
    if args.threads >= 2:
        one = fleetrl_on(1, args.threads, model_dir, batch, cfg, args.reps)
        two = fleetrl_on(2, args.threads // 2, model_dir, batch, cfg, args.reps)
        print(f"fleetrl train_step on 2 ranks ({args.threads // 2} thread(s) each): {two:.0f} tokens/s; on 1 rank "
              f"({args.threads} threads): {one:.0f} tokens/s; ratio {two / one:.2f}")
        record("trainer step, 2 ranks / 1 rank (tokens/s, same cores)", two / one,
               f"{two:.0f} vs {one:.0f} tokens/s")
    lora_against_full(model_dir, batch, cfg, args)


if __name__ == "__main__":
    main()
