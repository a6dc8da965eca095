"""The training loop every trainer rank runs: step n reads batch n and produces version n.

Each step trains, publishes version n from rank 0 (with LoRA, `trainer.lora`, the adapter
alone: trainer/lora.py), writes its metrics line, then checkpoints. How rank 0 publishes, from a
kept CPU snapshot or, on CUDA, from a `WeightGather` over the ranks' shards, is in
docs/architecture.md, "The GPU weight path" (the CUDA path has never run on a GPU:
docs/benchmarks.md, "GPU smoke: not run yet"); why the metrics line precedes the checkpoint, and
what a step or weights that are not finite do, in docs/reliability.md, "Nothing lost"."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fleetrl import failpoints
from fleetrl.batch import Batch
from fleetrl.config import Config
from fleetrl.errors import FleetrlError
from fleetrl.records import SftMetrics, StepMetrics
from fleetrl.rundir import RunDir
from fleetrl.trainer import checkpoint, distributed
from fleetrl.trainer.distributed import World
from fleetrl.trainer.gather import WeightGather, serve_gathers
from fleetrl.trainer.kept_weights import KeptWeights
from fleetrl.trainer.lora import adapter_config
from fleetrl.trainer.model import (agreement_probe, first_nonfinite, is_sharded, load_policy, local_shards,
                                   named_tensors, prompt_logprobs)
from fleetrl.trainer.schedule import Schedule
from fleetrl.trainer.step import StepConfig, build_optimizer, train_step

Snapshot = dict[str, torch.Tensor]


def step_config(config: Config) -> StepConfig:
    t = config.trainer
    return StepConfig(
        schedule=Schedule(lr=t.lr, warmup_steps=t.lr_warmup_steps, decay=t.lr_decay, decay_steps=t.lr_decay_steps,
                          lr_min=t.lr_min, max_steps=config.run.max_steps),
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm,
        micro_batch_tokens=t.micro_batch_tokens, loss=t.loss,
    )


@dataclass
class Hooks:
    """What the loop needs from its surroundings; ranks > 0 get the no-op defaults."""

    wait_batch: Callable[[int], Batch]
    start_rollouts: Callable[[int], None] = lambda start: None  # after the refit, from step `start` + 1
    # rank 0 only: (version, weights, probe token ids, the trainer's logprobs of them); the
    # weights are a Snapshot on the CPU, a WeightGather (valid during the call only) on CUDA
    publish: Callable[[int, Snapshot | WeightGather, list[int], list[float]], object] | None = None
    # rank 0 only, where the fleet attaches to workers: (the version the loop starts from, its
    # weights as CPU copies, probe token ids, the trainer's logprobs of them), before any step
    start_weights: Callable[[int, Snapshot, list[int], list[float]], None] | None = None
    on_step: Callable[[Batch, StepMetrics, object, float, float], None] = lambda *a: None


def snapshot(model: torch.nn.Module, rank: int) -> Snapshot:
    """The published weights (`model.named_tensors`: with LoRA the adapter's alone) on rank 0, as
    CPU copies; every rank must call this, in step."""
    tensors = {}
    for name, tensor in named_tensors(model):
        if rank == 0:
            tensors[name] = tensor.to("cpu", copy=True)
    return tensors


def streams_weights(world: World) -> bool:
    """Whether a publish streams the weights from the GPU (`publish_streamed`) rather than
    sending a CPU snapshot: on CUDA, where a full CPU copy of the model is not made."""
    return world.device.type == "cuda"


def publish(step: int, model: torch.nn.Module, world: World, probe_ids: list[int], hooks: Hooks) -> object:
    """Publishes the model as version `step` through `hooks.publish` (rank 0), with the
    trainer's logprobs of the agreement probe; every rank must call this, in step. Raises
    FleetrlError, publishing nothing, when a weight is not finite."""
    if streams_weights(world):
        return publish_streamed(step, model, world, probe_ids, hooks)
    weights = snapshot(model, world.rank)
    reference = prompt_logprobs(model, probe_ids, world.device)
    if not hooks.publish:
        return None
    bad = first_nonfinite(weights.items())
    if bad is not None:
        raise FleetrlError(f"step {step}: weight {bad} is not finite; version {step} not published")
    return hooks.publish(step, weights, probe_ids, reference)


def publish_streamed(step: int, model: torch.nn.Module, world: World, probe_ids: list[int], hooks: Hooks) -> object:
    """`publish` without a snapshot: rank 0 leads a gather session for the length of the
    publish hook, the other ranks serve it. Every rank checks its own shards for weights that
    are not finite (no gather needed) and all reach the same verdict."""
    bad = first_nonfinite(local_shards(model), across_ranks=True)
    reference = prompt_logprobs(model, probe_ids, world.device)
    if is_sharded(model):
        # FSDP2 keeps the root's parameters gathered after a forward (for the backward it
        # expects), in the compute dtype (bf16 on CUDA): sharded again, the gather sends the
        # fp32 master weights, as the snapshot does, and the GPU holds no whole embedding.
        model.reshard()
    if bad is not None:
        raise FleetrlError(f"step {step}: weight {bad} is not finite; version {step} not published")
    if world.rank > 0:
        serve_gathers(model, world)
        return None
    with WeightGather(model, world) as weights:  # leaving it lets the other ranks go on
        return hooks.publish(step, weights, probe_ids, reference) if hooks.publish else None


def hand_start_weights(model: torch.nn.Module, world: World, version: int, probe_ids: list[int],
                       hooks: Hooks) -> None:
    """The weights that attached workers are held to before they are labelled `version`
    (`Fleet.start`): the base model's (v0) or a resumed checkpoint's, copied from the trainer's
    freshly loaded model; every rank must call this, in step. Never a second model load in this
    process: transformers patches module creation process-wide while it loads, so a load on the
    control loop beside the trainer's would build one of the two models on the meta device.

    With LoRA these are the adapter's alone: an attached worker serves the base model from its
    own folder, and the agreement probe, scored through the adapter, proves the two agree."""
    weights = snapshot(model, world.rank)
    reference = prompt_logprobs(model, probe_ids, world.device)
    if hooks.start_weights:
        hooks.start_weights(version, weights, probe_ids, reference)


def nonfinite_step(metrics: StepMetrics | SftMetrics) -> str:
    """What made a skipped step skip, e.g. "loss is not finite"."""
    values = {"loss": metrics.loss, "grad norm": metrics.grad_norm}
    return ", ".join(f"{name} is not finite" for name, value in values.items() if value is None)


def train_peer(config: Config, run_dir: RunDir, model_dir: Path, world: World) -> None:
    """A rank other than 0: it trains on the batches rank 0's orchestrator writes into the run
    directory and takes part in every collective (steps, weight gathers, checkpoints); it waits
    for each batch without a deadline, since whoever started it (rank 0, or torchrun) ends it if
    the run fails."""
    distributed.use_cpus(config.trainer.cpu_cores, world)
    train(config, run_dir, model_dir, world, Hooks(wait_batch=run_dir.wait_batch), log=lambda *_: None)


def train(config: Config, run_dir: RunDir, model_dir: Path, world: World, hooks: Hooks, log=print) -> None:
    cfg = step_config(config)
    adapter = adapter_config(config.trainer.lora, model_dir)
    model = load_policy(model_dir, world.device, adapter=adapter)
    optimizer = build_optimizer(model, cfg)
    probe_ids = agreement_probe(model)
    # The KL penalty's reference is the base model, kept before a checkpoint replaces it (with
    # LoRA the fresh adapter, whose B = 0 adds nothing to the base).
    reference = None
    if cfg.loss.kl_coef > 0:
        reference = KeptWeights()
        reference.remember(model, 0)
    start = checkpoint.load(run_dir.checkpoints_dir, model, optimizer, log=log) or 0
    if start:
        log(f"fleetrl: resumed from checkpoint step {start}")
    # The fleet must serve the version the loop starts from before any rollout. Attached workers
    # are brought to it as the fleet starts, which sends nothing to a worker that holds it already
    # (a killed run's worker, left at the checkpoint's version); launched ones start at the base.
    if config.inference.attaches():
        hand_start_weights(model, world, start, probe_ids, hooks)
    elif start:
        publish(start, model, world, probe_ids, hooks)
    hooks.start_rollouts(start)
    interval = config.trainer.checkpoint_interval
    # Tokens one version behind are scored under their own version (trainer/mismatch.py): at
    # k = 0 there are none, and no copy of the weights is kept.
    previous = KeptWeights() if config.orchestrator.max_off_policy_steps > 0 else None
    for step in range(start + 1, config.run.max_steps + 1):
        batch = hooks.wait_batch(step)
        failpoints.hold("train", step)
        started = time.time()
        metrics = train_step(model, optimizer, batch, cfg, previous, reference)
        finished = time.time()
        if metrics.skipped:  # every rank sees it alike (train_step), so all stop or go on together
            if config.trainer.on_nonfinite == "stop":
                raise FleetrlError(f"step {step}: {nonfinite_step(metrics)}; the update was not applied "
                                   f"(to skip such steps and go on: trainer.on_nonfinite = skip)")
            log(f"fleetrl: step {step}: {nonfinite_step(metrics)}; the update was skipped: version {step} "
                f"repeats the weights of version {step - 1}")
        report = publish(step, model, world, probe_ids, hooks)
        hooks.on_step(batch, metrics, report, started, finished)
        if interval and (step % interval == 0 or step == config.run.max_steps):
            checkpoint.save(run_dir.checkpoints_dir, step, model, optimizer, keep=config.trainer.keep_checkpoints,
                            adapter=adapter)
