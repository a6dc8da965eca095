"""The orchestrator: samples groups from the fleet, scores them, assembles batch `n` for step `n`.

Off-policy control, with k = `max_off_policy_steps`:

- admission: rollouts for batch n are dispatched only once the fleet serves version
  >= (n - 1) - k, so every token they produce is at most k versions behind the policy that
  trainer step n starts from (version n - 1). k = 0: strictly on-policy, sampling for batch n
  waits for version n - 1; k >= 1: sampling for batch n overlaps training of step n - 1.
- assembly: each sample's distance is recomputed from its own version spans,
  (n - 1) - min(span versions); a sample above k is dropped and counted, never trained on.
- a sample whose spans name versions the fleet never served while it ran (a worker at the
  wrong version) is rejected and counted (`misversioned`), and left out of its group's
  advantage baseline.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from fleetrl.batch import Batch, Sample
from fleetrl.config import OrchestratorConfig
from fleetrl.envs import Environment, Rollout, Task, score, task_stream
from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import GenerateRequest, GenerateResponse, SamplingParams
from fleetrl.orchestrator.advantages import group_advantages
from fleetrl.rundir import RunDir
from fleetrl.versions import off_policy_distance


@dataclass
class Scored:
    task: Task
    prompt_ids: list[int]
    completion: GenerateResponse
    text: str
    reward: float


class Orchestrator:
    def __init__(self, fleet: Fleet, env: Environment, tokenizer, config: OrchestratorConfig,
                 run_dir: RunDir, seed: int, log=print) -> None:
        self.fleet = fleet
        self.env = env
        self.tokenizer = tokenizer
        self.config = config
        self.run_dir = run_dir
        self.log = log
        self._tasks = task_stream(env, seed)
        self.sampling = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            max_tokens=config.max_tokens,
            stop_token_ids=(tokenizer.eos_token_id,),
        )

    async def run(self, first_step: int, last_step: int) -> None:
        """Write batches first_step..last_step, each as soon as admission allows."""
        for step in range(first_step, last_step + 1):
            self.run_dir.write_batch(await self.make_batch(step))

    async def make_batch(self, step: int) -> Batch:
        k = self.config.max_off_policy_steps
        admitted = (step - 1) - k
        waited_from = time.time()
        await self.fleet.wait_for_version(admitted)
        started = time.time()
        dispatch_version = self.fleet.version
        tasks = [next(self._tasks) for _ in range(self.config.batch_prompts)]
        groups = await asyncio.gather(*(self._sample_group(step, i, task) for i, task in enumerate(tasks)))
        finished = time.time()

        samples, records, dropped, misversioned = [], [], 0, 0
        for group_index, group in enumerate(groups):
            rejected = [s for s in group if s.completion.version_error]
            misversioned += len(rejected)
            group = [s for s in group if not s.completion.version_error]
            for scored in rejected:
                records.append(self._record(step, group_index, scored, None, trained=False))
            if not group:
                continue
            advantages = group_advantages([s.reward for s in group], self.config.normalize_advantages_std)
            for scored, advantage in zip(group, advantages):
                c = scored.completion
                kept = off_policy_distance(step, c.spans) <= k
                if kept:
                    samples.append(Sample(
                        prompt_ids=scored.prompt_ids,
                        completion_ids=c.token_ids,
                        inference_logprobs=c.logprobs,
                        spans=c.spans,
                        reward=scored.reward,
                        advantage=advantage,
                        group=group_index,
                    ))
                else:
                    dropped += 1
                records.append(self._record(step, group_index, scored, advantage, trained=kept))
        self.run_dir.write_rollouts(step, records)
        if misversioned:
            self.log(f"fleetrl: batch {step}: rejected {misversioned} sample(s) from a worker at the wrong version")
        if not samples:
            raise FleetrlError(f"batch {step} is empty: of {len(records)} samples {dropped} exceeded "
                               f"orchestrator.max_off_policy_steps = {k} and {misversioned} were misversioned")
        rewards = [r["reward"] for r in records]
        distances = [off_policy_distance(step, s.spans) for s in samples]
        mean = sum(rewards) / len(rewards)
        meta = {
            "waited_from": waited_from,
            "rollout_started": started,
            "rollout_finished": finished,
            "dispatch_version": dispatch_version,
            "reward_mean": mean,
            "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
            "distance_max": max(distances),
            "distance_mean": sum(distances) / len(distances),
            "max_off_policy_steps": k,
            "misversioned": misversioned,
        }
        return Batch(step=step, samples=samples, dropped=dropped, meta=meta)

    async def _sample_group(self, step: int, index: int, task: Task) -> list[Scored]:
        prompt_ids = self.tokenizer.apply_chat_template(task.messages, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
        request = GenerateRequest(prompt_token_ids=prompt_ids, sampling=self.sampling, n=self.config.group_size,
                                  session_id=f"step{step}-group{index}")
        completions = await self.fleet.generate(request)
        scored = []
        for completion in completions:
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            reward = score(self.env, Rollout(task=task, completion=text, spans=completion.spans, step=step))
            scored.append(Scored(task=task, prompt_ids=prompt_ids, completion=completion, text=text, reward=reward))
        return scored

    @staticmethod
    def _record(step: int, group: int, scored: Scored, advantage: float | None, trained: bool) -> dict:
        c = scored.completion
        return {
            "step": step, "group": group, "task": scored.task.id, "completion": scored.text,
            "reward": scored.reward, "advantage": advantage, "worker": c.worker_id,
            "prefill_worker": c.prefill_worker_id, "spans": [[s.version, s.start] for s in c.spans], "distance": off_policy_distance(step, c.spans),
            "trained": trained, "version_error": c.version_error,
        }
