"""arithmetic: one small sum, difference or product, answered inside `<answer>` tags.

    reward = FORMAT_WEIGHT  * [the completion holds exactly one <answer>N</answer>, N an integer]
           + CORRECT_WEIGHT * [that N is the right result]

Correctness is only read from the tag: an answer the orchestrator cannot parse is no answer,
so a right number in free text earns nothing. The format part is there so a model that cannot
yet compute still gets a gradient towards answers that can be checked at all.
"""

from __future__ import annotations

import operator
import random
import re
from collections.abc import Iterator

from fleetrl.envs.base import HeldOutSplit, Rollout, Task

FORMAT_WEIGHT = 0.2
CORRECT_WEIGHT = 0.8

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

PROMPT = "What is {a} {op} {b}? Give the final result as an integer inside answer tags: <answer>N</answer>."

# Two worked examples open the conversation: without them SmolLM2-135M-Instruct almost never
# uses the tags (base reward ~0, no signal); with them 84% of samples do and 30% are right.
EXAMPLES = [
    {"role": "user", "content": PROMPT.format(a=3, op="+", b=4)},
    {"role": "assistant", "content": "3 + 4 = 7\n<answer>7</answer>"},
    {"role": "user", "content": PROMPT.format(a=6, op="*", b=7)},
    {"role": "assistant", "content": "6 * 7 = 42\n<answer>42</answer>"},
]

_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_INTEGER = re.compile(r"[-+]?\d+")


class Arithmetic(HeldOutSplit):
    name = "arithmetic"

    def __init__(self, max_operand: int = 20, ops: str = "+-*") -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        if not ops or set(ops) - set(OPERATORS):
            raise ValueError(f"ops must be a non-empty string of {''.join(OPERATORS)}, got {ops!r}")
        self.max_operand = max_operand
        self.ops = ops

    def generate(self, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        index = 0
        while True:
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice(self.ops)
            yield Task(
                id=f"{seed}-{index}",
                messages=[*EXAMPLES, {"role": "user", "content": PROMPT.format(a=a, op=op, b=b)}],
                answer=OPERATORS[op](a, b),
            )
            index += 1

    def reward(self, rollout: Rollout) -> float:
        answer = parse_answer(rollout.completion)
        if answer is None:
            return 0.0
        return FORMAT_WEIGHT + CORRECT_WEIGHT * (answer == rollout.task.answer)


def parse_answer(text: str) -> int | None:
    """N of the one `<answer>N</answer>` in `text`; None when there is not exactly one, or N
    is not an integer."""
    found = _ANSWER.findall(text)
    if len(found) != 1 or not _INTEGER.fullmatch(found[0]):
        return None
    return int(found[0])
