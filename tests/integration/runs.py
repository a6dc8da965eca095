"""Every `fleetrl rl` run the suite makes, in one table: its name, its command, what it covers,
and the test module that makes it.

A documented command (README.md, docs/quickstart.md) runs as written, changed only in its run
directory, ports and step count (tests/documented.py). The other runs add what their coverage
needs. The runs of test_rl_e2e.py are module fixtures that small tests read; the fault runs
are sequences driven by one test each, since each of their steps depends on the one before.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunSpec:
    command: str  # a documented command as written, or what the test adds to `fleetrl rl`
    covers: str
    module: str


ATTACHED_RUN = (".venv/bin/fleetrl rl @ configs/default.toml --inference.urls "
                "'[\"http://127.0.0.1:8001\", \"http://127.0.0.1:8002\"]' --run.dir runs/attached")
DYNAMO_RUN = ".venv/bin/fleetrl rl @ configs/default.toml --inference.provider dynamo --run.dir runs/dynamo"

RUNS: dict[str, RunSpec] = {
    "make-run": RunSpec(
        "make run",
        "README's and the quickstart's first run as written (1 vLLM worker, 1 trainer rank, k = 1), 2 steps, in a "
        "terminal: the live view and the log lines, rollouts overlapping training, the final model, the events",
        "test_rl_e2e.py"),
    "resume": RunSpec(
        'make run ARGS="--run.max_steps 15"',
        "the quickstart's resume as written, on what make-run left (to step 3): it resumes from the checkpoint, "
        "the workers serve the checkpoint's version first; then the quickstart's status, verify, plot and "
        "TensorBoard on the finished run",
        "test_rl_e2e.py"),
    "lora": RunSpec(
        'make run ARGS="@ configs/lora.toml --run.dir runs/lora"',
        "the quickstart's LoRA run as written (section 8: 1 launched vLLM worker with --enable-lora, 1 trainer "
        "rank, k = 1), 2 steps: only the adapter published (the bytes each worker received), the probe scored "
        "through it, checkpoints of the adapter alone, the merged final model, and the adapter exported with "
        "--adapter and served by a plain vLLM server on the base model",
        "test_rl_e2e.py"),
    "torchrun-dynamo": RunSpec(
        "torchrun --nnodes 2 --nproc-per-node 1 -m fleetrl rl @ rl.toml --inference.provider dynamo "
        "--inference.workers 1 --inference.dynamo.prefill_workers 1 --inference.dynamo.discovery etcd "
        "--inference.dynamo.event_plane nats --orchestrator.env verifiers:fleetrl_retry_sum "
        "--orchestrator.max_turns 2 --orchestrator.max_off_policy_steps 0 --run.wandb true",
        "a cluster as this machine can simulate one: 2 FSDP2 ranks on two torchrun nodes, Dynamo with etcd and "
        "NATS launched by fleetrl, a prefill and a decode worker in every publish, a verifiers multi-turn taskset "
        "(versions in every turn of every trace), k = 0 (no overlap), W&B offline, a learning rate decayed "
        "linearly, the geometric mask, evaluation of every version on held-out arithmetic prompts, 2 steps",
        "test_rl_e2e.py"),
    "attached": RunSpec(
        ATTACHED_RUN,
        "the quickstart's section 6 as written (1 trainer rank) on two servers started by its own commands: the "
        "base weights from the trainer's own copy, 1 step",
        "test_kill_points.py"),
    "kill-points": RunSpec(
        "fleetrl rl @ configs/default.toml @ rl.toml --inference.urls [one server] (2 trainer ranks, k = 0, two "
        "environments; six runs, each with a failpoint)",
        "killed at each point of a step (SIGKILL mid-rollout and mid-publish, SIGINT mid-train, SIGTERM "
        "mid-checkpoint, a dead trainer rank), each run resuming what the last left on the same server, the last "
        "two in rolling mode (inference.publish = 'rolling': each publish a canary wave); the "
        "final model exported and served by plain vLLM, then scored by the quickstart's `fleetrl eval` on the run's "
        "server (held to its weights at v5 first, 8 held-out prompts per environment, every token at v5, the table "
        "the records' figures); the KL penalty to the base model, its reference kept "
        "across every resume; two environments in one run (reverse_text, and dataset on examples/math/sums.jsonl "
        "with the math reward), drawn by weight, every group of every resume the uninterrupted stream's task; "
        "dynamic sampling (a third prompt while a group scored alike)",
        "test_kill_points.py"),
    "hung-worker": RunSpec(
        "fleetrl rl @ rl.toml (2 launched workers, 1 rank, k = 0, the multi-turn Guess of examples/my_envs/, "
        "named by its import path)",
        "a worker frozen with SIGSTOP leaves the fence, is restarted and readmitted; a user's environment, "
        "outside fleetrl, trained by import path; multi-turn episodes with a span per turn; SIGTERM of fleetrl "
        "with one rank leaves no process",
        "test_chaos.py"),
    "dynamo-lora": RunSpec(
        ".venv/bin/fleetrl rl @ configs/default.toml @ configs/lora.toml --inference.provider dynamo "
        "--inference.dynamo.worker fleetrl --trainer.world_size 2 --run.max_steps 3 --run.dir runs/dynamo-lora",
        "docs/dynamo.md's LoRA command with 2 trainer ranks (the adapter sharded by FSDP2, gathered for each "
        "publish), on fleetrl's Dynamo worker kind (abort pauses, its default under an adapter): the worker "
        "SIGKILLed after step 1, replaced by a worker admitted once it serves the adapter (/engine/load_lora), "
        "refitted with the trained adapter; the adapter's bytes alone in every publish, the sampler's logprobs "
        "the trainer's, fleetrl verify",
        "test_chaos.py"),
    "math-example": RunSpec(
        ".venv/bin/fleetrl rl @ examples/math/rl.toml --model.path runs/math-sft/final_model",
        "docs/examples.md's worked example as written, 1 step of each training command: `fleetrl eval` of the "
        "base model (64 held-out prompts per environment, mean ± standard error) beside `fleetrl sft` (no "
        "worker), then GRPO from its final model (the workers' v0 logprobs are that model's) on a JSONL dataset "
        "with the math reward mixed with reasoning_gym:basic_arithmetic (step 1 trains samples of both), "
        "evaluating v0 and its last version on both; fleetrl verify",
        "test_example.py"),
    "dynamo": RunSpec(
        DYNAMO_RUN,
        "the quickstart's section 7 as written (Dynamo's own worker, wait pauses): 1 step trained, then SIGKILL in "
        "the second (the frontend, the worker and its engine core gone within 10 s)",
        "test_chaos.py"),
}
