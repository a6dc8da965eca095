"""The data of docs/examples.md's worked example: sums of two two-digit numbers, in two forms
(the sum in \\boxed{}, or in reasoning-gym's `<answer>` tags), as two JSONL files beside this
script (or in the folder given).

- sft.jsonl: conversations (`messages`) whose answers are worked out, tens and units apart:
  SFT_ROWS in this script's own prompt, the result in \\boxed{}, then GYM_ROWS exactly as the
  `reasoning_gym:basic_arithmetic` environment of rl.toml prompts (reasoning-gym's system prompt,
  its question), the result in `<answer>` tags: what `fleetrl sft` trains on;
- sums.jsonl: `prompt` and `answer`, what `fleetrl rl` trains on (`env = "dataset"`, the `math`
  reward) and evaluates on: the environment holds a seeded fraction of its rows out of training
  (`eval_fraction`).

The boxed conversations and sums.jsonl take disjoint pairs of numbers from one seeded shuffle of
all 8100, so no held-out sum was ever trained on. The reasoning-gym conversations are that
environment's own training tasks (`tasks`, which leaves its held-out split out by construction)
from a seed of their own, GYM_SEED, kept to the boxed conversations' pairs: no question that
rl.toml evaluates, in either environment, is among them. The same seeds write the same files:
`python examples/math/make_data.py` rewrites the committed ones as they are.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from fleetrl.envs.reasoning_gym import ReasoningGymEnvironment

PROMPT = "What is {a} + {b}? Put the final answer in \\boxed{{}}."
SEED = 0
SFT_ROWS = 2000
# rl.toml's reasoning-gym environment: its dataset and options, which the conversations' questions
# follow (a unit test checks that rl.toml names the same).
GYM_DATASET = "basic_arithmetic"
GYM_OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+"],
               "allow_parentheses": False, "allow_negation": False}
GYM_SEED = 1  # not rl.toml's run.seed (0): another stream of questions than training's
GYM_ROWS = 1000
GYM_QUESTION = re.compile(r"Calculate (\d+) \+ (\d+)\.")


def worked_steps(a: int, b: int) -> str:
    """The sum worked out tens and units apart: each part is a step a small model can take."""
    tens, units = a // 10 * 10 + b // 10 * 10, a % 10 + b % 10
    return f"{a} + {b} = {a // 10 * 10} + {b // 10 * 10} + {a % 10} + {b % 10} = {tens} + {units} = {a + b}."


def worked_answer(a: int, b: int) -> str:
    return f"{worked_steps(a, b)}\n\\boxed{{{a + b}}}"


def gym_conversations(pairs: set[tuple[int, int]]) -> list[dict]:
    """GYM_ROWS distinct training tasks of the reasoning-gym environment (seed GYM_SEED) whose
    sum is one of `pairs`, each answered worked out and in `<answer>` tags."""
    conversations, seen = [], set()
    for task in ReasoningGymEnvironment(GYM_DATASET, **GYM_OPTIONS).tasks(GYM_SEED):
        a, b = map(int, GYM_QUESTION.fullmatch(task.messages[-1]["content"]).groups())
        if (a, b) in pairs and (a, b) not in seen:
            seen.add((a, b))
            answer = f"{worked_steps(a, b)}\n<answer>{a + b}</answer>"
            conversations.append({"messages": [*task.messages, {"role": "assistant", "content": answer}]})
            if len(conversations) == GYM_ROWS:
                return conversations


def rows(seed: int = SEED) -> dict[str, list[dict]]:
    """Each file's rows: all pairs of two-digit numbers in one seeded order, the first SFT_ROWS
    worked out for SFT (then reasoning-gym's questions of those pairs), the rest as RL prompts."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    boxed = [{"messages": [{"role": "user", "content": PROMPT.format(a=a, b=b)},
                           {"role": "assistant", "content": worked_answer(a, b)}]} for a, b in pairs[:SFT_ROWS]]
    return {
        "sft": boxed + gym_conversations(set(pairs[:SFT_ROWS])),
        "sums": [{"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b)} for a, b in pairs[SFT_ROWS:]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=Path(__file__).parent,
                        help="The folder to write sft.jsonl and sums.jsonl into [default: beside this script].")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    for name, table in rows().items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in table))
        print(f"{out / name}.jsonl: {len(table)} rows")


if __name__ == "__main__":
    main()
