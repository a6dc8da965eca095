"""fleetrl against TRL's GRPOTrainer on the same job: wall time per step and reward after N steps.

    .venv/bin/python benchmarks/bench_trl.py [--steps 6]     # needs the `bench` extra (TRL)

Both train SmolLM2-135M-Instruct (the embedded default) on the built-in reverse_text task with
fleetrl's defaults (configs/default.toml): 8 prompts per step, 4 samples per prompt, at most 24
completion tokens, temperature 1, learning rate 2e-5, no KL term, clipping 0.2 / 0.28,
token-level loss normalization, group-normalized advantages, one optimizer step per batch,
fp32 on the CPU. The prompts are the same (the task stream of seed 0) and so is the reward
(fleetrl's reverse_text reward, called from TRL as a reward function).

TRL generates with transformers: its vLLM modes (server and colocate) sync weights through
vLLM's NCCL weight-transfer engine, which needs a CUDA device (trl/generation/vllm_client.py
says so), so neither runs on this CPU machine. fleetrl samples on a vLLM CPU worker, one step
ahead of the trainer (k = 1), as `make run` does.

Time per step is the median time between optimizer steps after the first (which pays for
start-up); the reward is the mean of the last two steps'. The two run one after the other in
this one process's lifetime, on the same cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_report import record
from fleetrl.config import ModelConfig, load_config
from fleetrl.envs import get_environment
from fleetrl.envs.base import Rollout, score
from fleetrl.model import resolve_model

ROOT = Path(__file__).resolve().parents[1]


def run_trl(args, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    config = load_config([ROOT / "configs" / "default.toml"], [])
    orchestrator, trainer = config.orchestrator, config.trainer
    env = get_environment(orchestrator.env)
    stream = env.tasks(config.run.seed)
    tasks = [next(stream) for _ in range(orchestrator.batch_prompts * args.steps)]
    dataset = Dataset.from_list([{"prompt": t.messages, "task": i} for i, t in enumerate(tasks)])

    def reward(completions, task, **_):
        return [score(env, Rollout(tasks[i], c[0]["content"], [], 0)) for c, i in zip(completions, task)]

    step_ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.monotonic())

    model_dir = resolve_model(ModelConfig())
    micro = orchestrator.batch_prompts  # 8 completions per forward, 4 accumulated: one step per batch
    grpo = GRPOConfig(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=orchestrator.batch_prompts * orchestrator.group_size // micro,
        num_generations=orchestrator.group_size, max_completion_length=orchestrator.max_tokens,
        temperature=orchestrator.temperature, top_p=orchestrator.top_p, learning_rate=trainer.lr,
        beta=0.0, epsilon=trainer.clip_low, epsilon_high=trainer.clip_high, loss_type="dapo",
        scale_rewards="group" if orchestrator.normalize_advantages_std else "none",
        max_grad_norm=trainer.max_grad_norm, weight_decay=trainer.weight_decay,
        lr_scheduler_type="constant", warmup_steps=0, use_cpu=True, bf16=False, logging_steps=1,
        report_to="none", save_strategy="no", seed=config.run.seed, shuffle_dataset=False,
    )
    trl_trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=reward, args=grpo, train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir, padding_side="left"), callbacks=[StepTimes()],
    )
    trl_trainer.train()
    rewards = [entry["reward"] for entry in trl_trainer.state.log_history if "reward" in entry]
    return {"step_s": statistics.median(b - a for a, b in zip(step_ends, step_ends[1:])),
            "reward_last": sum(rewards[-2:]) / len(rewards[-2:]), "reward_first": rewards[0]}


def run_fleetrl(args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "fleetrl", "rl", "@", str(ROOT / "configs" / "default.toml"), "--run.dir", str(out),
           "--run.max_steps", str(args.steps), "--trainer.checkpoint_interval", "0", "--run.live_view", "off"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ends = [m["train_finished"] for m in metrics]
    return {"step_s": statistics.median(b - a for a, b in zip(ends, ends[1:])),
            "reward_last": sum(m["reward_mean"] for m in metrics[-2:]) / 2, "reward_first": metrics[0]["reward_mean"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("bench_trl.py needs TRL: pip install -e '.[bench]'")
    with tempfile.TemporaryDirectory() as tmp:
        results = {"TRL GRPOTrainer": run_trl(args, Path(tmp) / "trl"), "fleetrl": run_fleetrl(args, Path(tmp) / "fleetrl")}
    for name, r in results.items():
        print(f"{name}: {r['step_s']:.1f} s/step; reward {r['reward_first']:.3f} at step 1, "
              f"{r['reward_last']:.3f} over the last two of {args.steps} steps")
    speedup = results["TRL GRPOTrainer"]["step_s"] / results["fleetrl"]["step_s"]
    print(f"time per step, TRL / fleetrl: {speedup:.2f}")
    record("time per step, TRL GRPOTrainer / fleetrl", speedup,
           f"{results['TRL GRPOTrainer']['step_s']:.1f} vs {results['fleetrl']['step_s']:.1f} s/step; reward after "
           f"{args.steps} steps {results['TRL GRPOTrainer']['reward_last']:.3f} vs {results['fleetrl']['reward_last']:.3f}")


if __name__ == "__main__":
    main()
