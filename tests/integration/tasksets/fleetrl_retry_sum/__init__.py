"""fleetrl_retry_sum: a verifiers v1 multi-turn taskset for the end-to-end run (importable from
tests/integration/tasksets, which the test puts on PYTHONPATH).

A small sum; the taskset's own `Env` tells the model when it is wrong and asks once more. The
reward is 1 for a right last answer, so a retry that gets there earns it too.
"""

import random

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def right(self, trace: vf.Trace) -> float:
        return float(self.data.answer in (trace.last_reply or ""))


class RetrySumEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            if not segment.terminated and task.data.answer not in segment.last_reply:
                await chat.turn("Not quite. Try again, with the number only.")


class RetrySumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(0)
        for _ in range(32):
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            yield SumTask(SumData(prompt=f"What is {a} + {b}? Answer with the number only.", answer=str(a + b)),
                          self.config.task)


__all__ = ["RetrySumTaskset", "RetrySumEnv"]
