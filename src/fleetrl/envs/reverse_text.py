"""reverse_text: write a few random letters backwards.

The text is 3 to 5 random lowercase letters by default. Letters rather than words: a word is
one token the model would have to spell out, while random letters mostly tokenize one by one,
so reversing them is within reach of a 135M model. Two worked examples open the conversation,
because a small model copies a demonstrated answer shape far more reliably than it follows an
instruction.

    reward = 1 - levenshtein(target, answer) / max(len(target), len(answer))

A near miss earns most of the credit, so every character the model gets right moves the
reward: SmolLM2-135M-Instruct starts around 0.2 at temperature 1 and has room to climb. The
answer is the completion with surrounding whitespace, quotes, backticks and emphasis stripped,
compared case-insensitively (capitalizing the first letter is not what this task is about).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from fleetrl.envs.base import HeldOutSplit, Rollout, Task

LETTERS = "abcdefghijklmnopqrstuvwxyz"

PROMPT = "Reverse the following text, character by character. Answer with only the reversed text.\n\nText: {text}"

EXAMPLES = [
    {"role": "user", "content": PROMPT.format(text="hello")},
    {"role": "assistant", "content": "olleh"},
    {"role": "user", "content": PROMPT.format(text="qwz")},
    {"role": "assistant", "content": "zwq"},
]

_STRIP = " \t\r\n\"'`*"


class ReverseText(HeldOutSplit):
    name = "reverse_text"

    def __init__(self, min_len: int = 3, max_len: int = 5) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len} and {max_len}")
        self.min_len = min_len
        self.max_len = max_len

    def generate(self, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        index = 0
        while True:
            text = "".join(rng.choice(LETTERS) for _ in range(rng.randint(self.min_len, self.max_len)))
            yield Task(
                id=f"{seed}-{index}",
                messages=[*EXAMPLES, {"role": "user", "content": PROMPT.format(text=text)}],
                answer=text[::-1],
            )
            index += 1

    def reward(self, rollout: Rollout) -> float:
        return similarity(rollout.task.answer, rollout.completion.strip(_STRIP).lower())


def similarity(target: str, answer: str) -> float:
    """1 - normalized Levenshtein distance: 1 for equal strings, 0 for nothing in common."""
    if not target and not answer:
        return 1.0
    return 1.0 - levenshtein(target, answer) / max(len(target), len(answer))


def levenshtein(a: str, b: str) -> int:
    """Edits (insert, delete, substitute one character) that turn `a` into `b`."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]
