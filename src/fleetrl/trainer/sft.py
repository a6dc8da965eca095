"""`fleetrl sft`'s training loop, which every trainer rank runs: step n trains on the rows the
data picks for step n (`SftData.step_rows`, the same on every rank) with the mean NLL of their
assistant tokens, then the run's final model is written from the last step's weights.

Packing reuses the RL step's layout (trainer/step.py): a sequence is a Sample whose "prompt" is
its first token and whose "completion" is the rest, the loss mask on the assistant's tokens.
Sequences that begin with the same token (every conversation of a chat template) share one
unit, so `prompt_units` packs several of them into one row of at most `micro_batch_tokens`
tokens, each seeing the shared first token and itself only, at the positions it would have
alone; rows are then cut into micro-batches of at most that many tokens (rows x padded
length). A step of many short conversations is a few full rows, not one forward each, and its
peak memory is one micro-batch's. Each rank takes every world_size-th sequence, longest first,
and packs its own; all ranks run as many micro-batches (each FSDP forward is a collective),
those with nothing left a zero-loss one-token forward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fleetrl.batch import Sample
from fleetrl.config import Config
from fleetrl.errors import FleetrlError
from fleetrl.records import SftMetrics
from fleetrl.rundir import RunDir
from fleetrl.sft_data import Sequence, SftData
from fleetrl.trainer import checkpoint, distributed
from fleetrl.trainer.distributed import World
from fleetrl.trainer.gather import WeightGather, serve_gathers
from fleetrl.trainer.loop import nonfinite_step, snapshot, step_config, streams_weights
from fleetrl.trainer.lora import adapter_config
from fleetrl.trainer.model import compute_precision, is_sharded, load_policy
from fleetrl.trainer.step import (StepConfig, Unit, build_optimizer, clip_grad_norm, finite_or_none, idle_forward,
                                  micro_batches, pack, prompt_units, token_logprobs)

NamedTensors = Callable[[], Iterator[tuple[str, torch.Tensor]]]


def sequence_sample(sequence: Sequence) -> Sample:
    """A sequence in the RL step's packing layout: its first token the prompt, the rest the completion."""
    rest = len(sequence.token_ids) - 1
    return Sample(prompt_ids=sequence.token_ids[:1], completion_ids=sequence.token_ids[1:],
                  inference_logprobs=[0.0] * rest, spans=[], reward=0.0, advantage=0.0, group=0,
                  loss_mask=sequence.loss_mask[1:])


def rank_plans(samples: list[Sample], max_tokens: int, world_size: int) -> list[list[list[Unit]]]:
    """Each rank's micro-batches: every world_size-th sample, longest first, packed into rows."""
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].completion_ids), i))
    plans = []
    for rank in range(world_size):
        units = prompt_units([samples[i] for i in order[rank::world_size]], max_tokens)
        plans.append(micro_batches(sorted(units, key=lambda unit: -unit.tokens), max_tokens))
    return plans


def sft_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, sequences: list[Sequence],
             cfg: StepConfig) -> SftMetrics:
    """One optimizer step on `sequences` (every rank calls this with the same ones)."""
    started = time.perf_counter()
    rank, world_size = distributed.rank(), distributed.world_size()
    device = next(model.parameters()).device
    samples = [sequence_sample(s) for s in sequences]
    loss_tokens = sum(s.trained_tokens() for s in samples)
    if loss_tokens == 0:
        raise FleetrlError(f"step {step}: its sequences hold no assistant token to train on")
    plans = rank_plans(samples, cfg.micro_batch_tokens, world_size)
    forwards = max(len(plan) for plan in plans)
    mine = plans[rank] + [[]] * (forwards - len(plans[rank]))
    model.train()
    nll = torch.zeros((), dtype=torch.float64, device=device)
    for micro in mine:
        with compute_precision(model, device):
            if micro:
                packed = pack(micro, device)
                logprobs, _ = token_logprobs(model, packed)
                summed = -(logprobs * packed.mask).sum()
                nll += summed.detach().double()
                loss = summed / loss_tokens  # the gradients are summed over ranks (FSDP's divide factor is 1)
            else:
                loss = idle_forward(model, device)
        loss.backward()
    grad_norm = clip_grad_norm(model, cfg.max_grad_norm)
    if world_size > 1:
        dist.all_reduce(nll)
    mean_nll = nll.item() / loss_tokens
    skipped = not (math.isfinite(mean_nll) and math.isfinite(grad_norm))  # alike on every rank
    lr = cfg.schedule.rate(step)
    if not skipped:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = sum(len(s.token_ids) for s in sequences)
    return SftMetrics(step=step, skipped=skipped, loss=finite_or_none(mean_nll), grad_norm=finite_or_none(grad_norm),
                      lr=lr, sequences=len(sequences), loss_tokens=loss_tokens, tokens=tokens, micro_batches=forwards,
                      tokens_per_s=tokens / (time.perf_counter() - started))


def train_sft_peer(config: Config, run_dir: RunDir, model_dir: Path, world: World) -> None:
    """A rank other than 0: it reads the data itself and takes part in every collective."""
    from transformers import AutoTokenizer

    distributed.use_cpus(config.trainer.cpu_cores, world)
    data = SftData(config.sft, AutoTokenizer.from_pretrained(model_dir), config.run.seed)
    train_sft(config, run_dir, model_dir, world, data.step_sequences, on_step=lambda *a: None, write_final=None,
              log=lambda *_: None)


def train_sft(config: Config, run_dir: RunDir, model_dir: Path, world: World,
              sequences: Callable[[int], list[Sequence]], on_step: Callable[[SftMetrics, float, float], None],
              write_final: Callable[[NamedTensors], None] | None, log=print) -> None:
    """Steps after the newest checkpoint to run.max_steps, then the final model: rank 0 gets
    `on_step` (metrics, start and end time) and `write_final`; the others pass no-ops / None."""
    cfg = step_config(config)
    adapter = adapter_config(config.trainer.lora, model_dir)
    model = load_policy(model_dir, world.device, adapter=adapter)
    optimizer = build_optimizer(model, cfg)
    start = checkpoint.load(run_dir.checkpoints_dir, model, optimizer, log=log) or 0
    if start:
        log(f"fleetrl: resumed from checkpoint step {start}")
    interval = config.trainer.checkpoint_interval
    for step in range(start + 1, config.run.max_steps + 1):
        started = time.time()
        metrics = sft_step(model, optimizer, step, sequences(step), cfg)
        if metrics.skipped:
            why = nonfinite_step(metrics)
            if config.trainer.on_nonfinite == "stop":
                raise FleetrlError(f"step {step}: {why}; the update was not applied (to skip such steps and go on: "
                                   "trainer.on_nonfinite = skip)")
            log(f"fleetrl: step {step}: {why}; the update was skipped")
        on_step(metrics, started, time.time())
        if interval and (step % interval == 0 or step == config.run.max_steps):
            checkpoint.save(run_dir.checkpoints_dir, step, model, optimizer, keep=config.trainer.keep_checkpoints,
                            adapter=adapter)
    hand_final_weights(model, world, write_final)


def hand_final_weights(model: nn.Module, world: World, write: Callable[[NamedTensors], None] | None) -> None:
    """The trained weights (with LoRA the adapter's alone) to rank 0's `write`, as full tensors;
    every rank must call this. On CUDA they are gathered one at a time (no CPU copy of the
    model), on the CPU copied into a snapshot as `fleetrl rl` publishes them."""
    if not streams_weights(world):
        weights = snapshot(model, world.rank)
        if write is not None:
            write(lambda: iter(weights.items()))
        return
    if is_sharded(model):
        model.reshard()  # the gather sends the fp32 master weights, as after an RL step
    if world.rank > 0:
        serve_gathers(model, world)
        return
    with WeightGather(model, world) as weights:
        if write is not None:
            write(weights.tensors)
