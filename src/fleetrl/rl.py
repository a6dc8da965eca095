"""`fleetrl rl`: the fleet, the trainer ranks and the orchestrator, started and ended together.

Process layout: this process is trainer rank 0 and hosts the control side — the fleet
coordinator and the orchestrator run on an asyncio loop in a background thread, the training
loop in the main thread. Trainer ranks 1..N-1 are child processes; the inference workers are
child processes (or attached servers). Rank 0 is the broadcast sender, so publishing a
version is a call from the training loop into the coordinator in the same process: the
publish fence never spans a process boundary.

Everything started here is stopped on success, on the failure of any part, and on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from fleetrl.batch import Batch, batch_path
from fleetrl.config import Config, ConfigError, to_toml
from fleetrl.envs import get_environment
from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet import Fleet, PublishReport
from fleetrl.inference.types import GenerateRequest, SamplingParams, WorkerState
from fleetrl.orchestrator.rollouts import Orchestrator
from fleetrl.plots import write_plots
from fleetrl.processes import ManagedProcess, free_port, start_process
from fleetrl.rundir import read_metrics, write_manifest
from fleetrl.trainer import checkpoint, distributed
from fleetrl.trainer.loop import Hooks, Snapshot, train
from fleetrl.trainer.step import StepMetrics
from fleetrl.weights.transport import make_transport


def check_config(config: Config) -> None:
    o = config.orchestrator
    # vLLM reports logprobs of the untempered distribution; the importance ratio is only
    # right if the samples came from that same distribution.
    if o.temperature != 1.0 or o.top_p != 1.0:
        raise ConfigError("fleetrl rl samples at orchestrator.temperature = 1 and orchestrator.top_p = 1 "
                          "(the trainer's importance ratio needs the distribution vLLM reports logprobs of)")


def prepare_run_dir(config: Config) -> int:
    """Create or resume the run directory; the step of the checkpoint to resume from, or 0."""
    run_dir = config.run.dir
    found = checkpoint.latest(run_dir / "checkpoints")
    resume = found[0] if found else 0
    if not resume and read_metrics(run_dir):
        raise FleetrlError(f"run.dir {run_dir} holds a run without a checkpoint to resume from; "
                           f"choose another run.dir or remove it")
    # Steps after the checkpoint are redone: drop their batches, rollouts and metric lines.
    for folder in ("batches", "rollouts"):
        for path in (run_dir / folder).glob("step_*"):
            if int(path.name.split("_")[1].split(".")[0]) > resume:
                path.unlink()
    kept = [m for m in read_metrics(run_dir) if m["step"] <= resume]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    (run_dir / "config.toml").write_text(to_toml(config))
    (run_dir / "manifest.json").unlink(missing_ok=True)
    return resume


class ControlLoop:
    """An asyncio loop in a daemon thread, for the fleet and the orchestrator."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fleetrl-control", daemon=True)
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro):
        return self.submit(coro).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def start_trainer_ranks(config: Config, model_dir: Path) -> list[ManagedProcess]:
    """Ranks 1..N-1 as children; sets this process up as rank 0 of the same group."""
    world_size = config.trainer.world_size
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")), "WORLD_SIZE": str(world_size)}
    os.environ.update({**env, "RANK": "0", "LOCAL_RANK": "0"})
    return [
        start_process(f"trainer-rank-{rank}", [sys.executable, "-m", "fleetrl.trainer", str(config.run.dir), str(model_dir)],
                      config.run.dir / "logs" / f"trainer-rank-{rank}.log",
                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        for rank in range(1, world_size)
    ]


def run_rl(config: Config, make_fleet, log=print) -> int:
    """`make_fleet(config, token) -> (Fleet, model_dir)` builds the fleet for the chosen provider."""
    check_config(config)
    run_dir = config.run.dir
    resume = prepare_run_dir(config)
    options = dict(config.orchestrator.env_options)
    if config.orchestrator.env.startswith("verifiers:"):
        # verifiers users see each rollout's policy provenance in the episodes file.
        options.setdefault("episodes_path", run_dir / "verifiers_episodes.jsonl")
        options.setdefault("run_id", run_dir.name)
    env = get_environment(config.orchestrator.env, **options)
    token = config.inference.admin_token or secrets.token_urlsafe(24)
    fleet, model_dir = make_fleet(config, token)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    control = ControlLoop()
    transport = make_transport(
        config.inference.weight_transport, host=config.inference.sender_host,
        bucket_bytes=config.inference.weight_bucket_mb << 20,
        storage_dir=config.inference.weights_dir or run_dir / "weights",
        timeout_s=config.inference.transfer_timeout_s,
    )
    orchestrator = Orchestrator(fleet, env, tokenizer, config.orchestrator, run_dir, config.run.seed, log=log)
    fleet_started = control.submit(fleet.start())
    ranks = start_trainer_ranks(config, model_dir) if config.trainer.world_size > 1 else []
    world = distributed.init()
    torch.set_num_threads(max(1, torch.get_num_threads() // world.world_size))
    rollouts: list[Future] = []
    log(f"fleetrl: run {run_dir}: {config.run.max_steps} steps, k = {config.orchestrator.max_off_policy_steps}, "
        f"{config.trainer.world_size} trainer rank(s), env {env.name}" + (f", resuming after step {resume}" if resume else ""))

    def check_children() -> None:
        for rank in ranks:
            if not rank.alive():
                raise FleetrlError(f"{rank.name} died (exit code {rank.popen.returncode}); last lines of "
                                   f"{rank.log_path}: {rank.log_tail(3)}")
        for future in rollouts + [fleet_started]:
            if future.done() and future.exception():
                raise future.exception()

    def wait_fleet() -> None:
        while not fleet_started.done():
            check_children()
            time.sleep(0.2)
        fleet_started.result()

    def publish(step: int, weights: Snapshot) -> PublishReport:
        wait_fleet()
        report = control.run(fleet.publish(step, transport, lambda: iter(weights.items())))
        if not report.ready:
            raise FleetrlError(f"publish v{step} reached no worker")
        return report

    def on_ready(start: int) -> None:
        wait_fleet()
        rollouts.append(control.submit(orchestrator.run(start + 1, config.run.max_steps)))

    def wait_batch(step: int) -> Batch:
        path = batch_path(run_dir, step)
        while not path.exists():
            check_children()
            time.sleep(0.1)
        return Batch.load(path)

    def on_step(batch: Batch, metrics: StepMetrics, report: PublishReport, started: float, finished: float) -> None:
        line = {
            "step": batch.step,
            **{k: batch.meta[k] for k in ("reward_mean", "reward_std", "distance_max", "distance_mean")},
            "dropped": batch.dropped,
            "misversioned": batch.meta["misversioned"],
            "samples": metrics.samples,
            "loss": metrics.loss,
            "grad_norm": metrics.grad_norm,
            "mismatch_kl": metrics.mismatch_kl,
            "clip_frac": metrics.clip_frac,
            "tokens_per_s": metrics.tokens_per_s,
            "publish_s": report.seconds,
            "checksum": report.checksum,
            "worker_versions": {w.id: w.version for w in fleet.workers.values() if w.state == WorkerState.READY},
            "failed_workers": report.failed,
            "rollout_started": batch.meta["rollout_started"],
            "rollout_finished": batch.meta["rollout_finished"],
            "train_started": started,
            "train_finished": finished,
        }
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        log(f"step {batch.step}/{config.run.max_steps}  reward {line['reward_mean']:.3f}±{line['reward_std']:.3f}  "
            f"off-policy max {line['distance_max']} mean {line['distance_mean']:.2f}  dropped {batch.dropped}  misversioned {line['misversioned']}  "
            f"loss {metrics.loss:+.4f}  kl {metrics.mismatch_kl:.2e}  train {finished - started:.1f}s  "
            f"publish {report.seconds:.1f}s  workers at {sorted(set(line['worker_versions'].values()))}")

    try:
        try:
            train(config, run_dir, model_dir, world, Hooks(wait_batch, on_ready, publish, on_step), log=log)
        except Exception:
            # A collective fails when a peer rank dies: name the rank rather than gloo's error.
            deadline = time.monotonic() + 5
            while ranks and all(r.alive() for r in ranks) and time.monotonic() < deadline:
                time.sleep(0.1)
            check_children()
            raise
        final = control.run(final_generation(fleet, tokenizer))
        (run_dir / "final.json").write_text(json.dumps(final, indent=1))
        write_plots(run_dir, read_metrics(run_dir))
        write_manifest(run_dir)
        log(f"fleetrl: done: {run_dir} (check it with `fleetrl verify {run_dir}`)")
        return 0
    finally:
        for future in rollouts:
            future.cancel()
        control.run(_close(fleet, transport))
        control.stop()
        distributed.destroy()
        for rank in ranks:
            rank.stop()


async def final_generation(fleet: Fleet, tokenizer) -> dict:
    """A 16-token greedy sample from the final policy, and every worker's version; each
    worker checks that all its ranks hold the weights of the trainer's last checksum."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write one sentence about the sea."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    (out,) = await fleet.generate(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)))
    workers = {}
    for worker in fleet.ready_workers():
        admin = fleet.provider.admin(worker)
        if fleet.checksum is not None:
            await admin.verify_weights(fleet.checksum)
        workers[worker.id] = {"role": worker.role.value, "version": await admin.version(), "checksum": fleet.checksum}
    return {"version": fleet.version, "tokens": out.token_ids, "text": tokenizer.decode(out.token_ids),
            "spans": [[s.version, s.start] for s in out.spans], "workers": workers}


async def _close(fleet: Fleet, transport) -> None:
    await transport.close()
    await fleet.close()
