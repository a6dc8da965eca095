"""arithmetic_retry: the arithmetic task over several turns, the environment telling the model
when it is wrong. A multi-turn task without tools.

The model answers; a right answer ends the episode, a wrong or unreadable one gets feedback (a
user turn) and another try, up to `orchestrator.max_turns` turns in all:

    reward = 1 / t                   right at turn t (1, 1/2, 1/3, ...)
           = FORMAT_WEIGHT (0.1)     never right, but the last answer was readable
           = 0                       otherwise

Being right sooner is worth more, and a retry that gets there still beats giving up, so the
model has a reason both to read the feedback and to need less of it.
"""

from __future__ import annotations

from fleetrl.envs.arithmetic import Arithmetic, parse_answer
from fleetrl.envs.base import Rollout, Task

FORMAT_WEIGHT = 0.1

WRONG = "That is not right. Try again, and give only the final result as <answer>N</answer>."
UNREADABLE = "I cannot find exactly one <answer>N</answer> with an integer N in your reply. Try again."


class ArithmeticRetry(Arithmetic):
    name = "arithmetic_retry"

    def respond(self, task: Task, messages: list[dict[str, str]], state: dict) -> list[dict[str, str]] | None:
        answer = parse_answer(messages[-1]["content"])
        if answer == task.answer:
            return None
        return [{"role": "user", "content": UNREADABLE if answer is None else WRONG}]

    def reward(self, rollout: Rollout) -> float:
        answers = [parse_answer(m["content"]) for m in rollout.messages[len(rollout.task.messages):]
                   if m["role"] == "assistant"]
        for turn, answer in enumerate(answers, start=1):
            if answer == rollout.task.answer:
                return 1.0 / turn
        return FORMAT_WEIGHT if answers and answers[-1] is not None else 0.0
