"""shout: a single-turn environment. The model is asked to say a word in capitals; the reward
is 1 when the capitalized word is in its completion."""

import itertools
import random

from fleetrl.envs.base import Task


class Shout:
    name = "shout"

    def __init__(self, words=("sea", "sky", "sun")):  # its options: keyword arguments
        if not words:
            raise ValueError("words must name at least one word")
        self.words = list(words)

    def tasks(self, seed):
        rng = random.Random(seed)
        for i in itertools.count():
            word = rng.choice(self.words)
            yield Task(id=f"{seed}-{i}", messages=[{"role": "user", "content": f"Say {word} in capitals."}],
                       answer=word.upper())

    def reward(self, rollout):
        return float(rollout.task.answer in rollout.completion)
