"""guess: a multi-turn environment. The model guesses a secret number; each wrong guess is
answered with a hint (higher, lower) and another turn, until it is right or out of turns. The
reward is 1 / the number of turns taken, 0 when never right."""

import itertools
import random
import re

from fleetrl.envs.base import Task

NUMBER = re.compile(r"-?\d+")


def parse_number(text):
    """The first integer in `text`, or None."""
    found = NUMBER.search(text)
    return int(found.group()) if found else None


class Guess:
    name = "guess"
    tools = []

    def __init__(self, high: int = 100):
        if high < 1:
            raise ValueError(f"high must be at least 1, got {high}")
        self.high = high

    def tasks(self, seed):
        rng = random.Random(seed)
        prompt = f"I am thinking of a whole number from 1 to {self.high}. Guess it: reply with the number alone."
        for i in itertools.count():
            yield Task(id=f"{seed}-{i}", messages=[{"role": "user", "content": prompt}],
                       answer=rng.randint(1, self.high))

    def respond(self, task, messages, state):
        said = parse_number(messages[-1]["content"])
        if said == task.answer:
            return None
        hint = "higher" if said is None or said < task.answer else "lower"
        return [{"role": "user", "content": f"No: {hint}."}]

    def reward(self, rollout):
        turns = [m for m in rollout.messages[len(rollout.task.messages):] if m["role"] == "assistant"]
        return 1.0 / len(turns) if parse_number(turns[-1]["content"]) == rollout.task.answer else 0.0
