"""fleetrl against TRL's GRPOTrainer on the same job: wall time per step, time to a reward
level, and the held-out reward of the two trained models.

    .venv/bin/python benchmarks/bench_trl.py [--steps 20] [--reward-levels 0.3 0.35]   # needs the `bench` extra (TRL)

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

The figures, the same for both:
- time per step: the median time between optimizer steps after the first (which pays for
  start-up);
- time to a reward level: from the launch (TRL: before its model loads; fleetrl: the
  `fleetrl rl` command, which starts its vLLM worker) to the end of the first step at which the
  mean reward of the last WINDOW steps reaches the level (each of --reward-levels). A mean over
  several steps, because one step's 32 samples are few: their mean moves by about 0.05 from
  step to step;
- held-out reward: the base model and both final models generate greedily with transformers in
  this process, on the prompts fleetrl's evaluation uses (the first eval.prompts of
  reverse_text's held-out split, which neither trains on), each completion scored by the task's
  reward; pass@1 is the share that reach eval.pass_reward.

The two train one after the other in this one process's lifetime, on the same cores; the
scoring runs after both.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

from bench_report import record
from fleetrl.config import ModelConfig, load_config
from fleetrl.envs import get_environment
from fleetrl.envs.base import Rollout, eval_stream, score
from fleetrl.model import resolve_model
from fleetrl.orchestrator.chat import render_prompt
from fleetrl.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 3  # steps whose mean reward is compared with --reward-level


def run_trl(args, out: Path) -> dict:
    """Trains with TRL; each step's mean reward and end (seconds since the launch), and the final model's folder."""
    launched = time.monotonic()
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
        beta=0.0, epsilon=trainer.loss.clip_low, epsilon_high=trainer.loss.clip_high, loss_type="dapo",
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
    trl_trainer.save_model(str(out / "final_model"))
    rewards = [entry["reward"] for entry in trl_trainer.state.log_history if "reward" in entry]
    return {"rewards": rewards, "ends": [t - launched for t in step_ends], "model": out / "final_model"}


def run_fleetrl(args, out: Path) -> dict:
    """Trains with `fleetrl rl`; the same as run_trl returns, from the run's metrics."""
    launched = time.time()  # metrics.jsonl's times are wall-clock times
    cmd = [sys.executable, "-m", "fleetrl", "rl", "@", str(ROOT / "configs" / "default.toml"), "--run.dir", str(out),
           "--run.max_steps", str(args.steps), "--trainer.checkpoint_interval", "0", "--run.live_view", "off"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    metrics = RunDir(out).read_metrics()
    return {"rewards": [m.batch.reward_mean for m in metrics], "ends": [m.train_finished - launched for m in metrics],
            "model": out / "final_model"}


def first_step_at(rewards: list[float], level: float) -> int | None:
    """The first step (from 1) at which the mean reward of the last WINDOW steps is at least `level`."""
    return next((i + 1 for i in range(WINDOW - 1, len(rewards))
                 if statistics.mean(rewards[i - WINDOW + 1:i + 1]) >= level), None)


def held_out(model_dir: Path) -> dict:
    """A model folder's greedy completions of the held-out prompts with transformers, each scored by
    the task's reward. One prompt at a time: no padding, which could change a greedy completion."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_config([ROOT / "configs" / "default.toml"], [])
    env = get_environment(config.orchestrator.env)
    tasks = list(islice(eval_stream(env, config.run.seed, held_out_only=True), config.eval.prompts))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rewards = []
    with torch.no_grad():
        for task in tasks:
            prompt = torch.tensor([render_prompt(tokenizer, task.messages)])
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=config.orchestrator.max_tokens)
            text = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
            rewards.append(score(env, Rollout(task, text, [], 0)))
    return {"reward": statistics.mean(rewards), "pass@1": sum(r >= config.eval.pass_reward for r in rewards) / len(rewards),
            "prompts": len(rewards)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reward-levels", type=float, nargs="+", default=[0.3, 0.35],
                        help=f"mean rewards over {WINDOW} steps: the time to the first step at each is measured")
    args = parser.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("bench_trl.py needs TRL: pip install -e '.[bench]'")
    names = ("TRL GRPOTrainer", "fleetrl")
    with tempfile.TemporaryDirectory() as tmp:
        runs = dict(zip(names, (run_trl(args, Path(tmp) / "trl"), run_fleetrl(args, Path(tmp) / "fleetrl"))))
        base = held_out(resolve_model(ModelConfig()))
        scores = {name: held_out(run["model"]) for name, run in runs.items()}

    print("step  " + "  ".join(f"{name} reward, s since launch" for name in names))
    for step in range(1, args.steps + 1):
        print(f"{step:4d}  " + "  ".join(f"{runs[n]['rewards'][step - 1]:.3f} {runs[n]['ends'][step - 1]:7.1f}" for n in names))
    step_s = {n: statistics.median(b - a for a, b in zip(r["ends"], r["ends"][1:])) for n, r in runs.items()}
    for n in names:
        print(f"{n}: {step_s[n]:.1f} s/step; held-out reward {scores[n]['reward']:.3f}, pass@1 {scores[n]['pass@1']:.3f}")
    print(f"base model: held-out reward {base['reward']:.3f}, pass@1 {base['pass@1']:.3f} "
          f"({base['prompts']} prompts, greedy)")

    trl_name, ours = names
    speedup = step_s[trl_name] / step_s[ours]
    print(f"time per step, TRL / fleetrl: {speedup:.2f}")
    record("time per step, TRL GRPOTrainer / fleetrl", speedup, f"{step_s[trl_name]:.1f} vs {step_s[ours]:.1f} s/step")
    for level in args.reward_levels:
        reached = {n: first_step_at(runs[n]["rewards"], level) for n in names}
        at = {n: f"step {reached[n]}, {runs[n]['ends'][reached[n] - 1]:.0f} s after launch" if reached[n]
              else f"not within {args.steps} steps" for n in names}
        print(f"mean reward over {WINDOW} steps >= {level}: " + "; ".join(f"{n}: {at[n]}" for n in names))
        if all(reached.values()):
            to_level = {n: runs[n]["ends"][reached[n] - 1] for n in names}
            print(f"time to it, TRL / fleetrl: {to_level[trl_name] / to_level[ours]:.2f}")
            record(f"time to mean reward >= {level} over {WINDOW} steps, TRL GRPOTrainer / fleetrl",
                   to_level[trl_name] / to_level[ours], f"{at[trl_name]} vs {at[ours]}")
    print(f"held-out reward after {args.steps} steps, fleetrl / TRL: {scores[ours]['reward'] / scores[trl_name]['reward']:.2f}")
    record(f"held-out reward after {args.steps} steps (greedy), fleetrl / TRL GRPOTrainer",
           scores[ours]["reward"] / scores[trl_name]["reward"],
           f"{scores[ours]['reward']:.3f} vs {scores[trl_name]['reward']:.3f}; pass@1 {scores[ours]['pass@1']:.3f} vs "
           f"{scores[trl_name]['pass@1']:.3f}; base model {base['reward']:.3f}")


if __name__ == "__main__":
    main()
