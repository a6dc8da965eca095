"""The data of docs/examples.md's worked example: sums of two two-digit numbers, answered in
\\boxed{}, as two JSONL files beside this script (or in the folder given).

- sft.jsonl: conversations (`messages`) whose answers are worked out, tens and units apart,
  the result in \\boxed{}: what `fleetrl sft` trains on;
- sums.jsonl: `prompt` and `answer`, what `fleetrl rl` trains on (`env = "dataset"`, the `math`
  reward) and evaluates on: the environment holds a seeded fraction of its rows out of training
  (`eval_fraction`).

The two take disjoint pairs of numbers from one seeded shuffle of all 8100, so no held-out sum
was ever trained on, and the same seed writes the same files: `python examples/math/make_data.py`
rewrites the committed ones as they are.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROMPT = "What is {a} + {b}? Put the final answer in \\boxed{{}}."
SEED = 0
SFT_ROWS = 2000


def worked_answer(a: int, b: int) -> str:
    """The sum worked out tens and units apart: each part is a step a small model can take."""
    tens, units = a // 10 * 10 + b // 10 * 10, a % 10 + b % 10
    return (f"{a} + {b} = {a // 10 * 10} + {b // 10 * 10} + {a % 10} + {b % 10} = {tens} + {units} = {a + b}.\n"
            f"\\boxed{{{a + b}}}")


def rows(seed: int = SEED) -> dict[str, list[dict]]:
    """Each file's rows: all pairs of two-digit numbers in one seeded order, the first SFT_ROWS
    worked out for SFT, the rest as RL prompts."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return {
        "sft": [{"messages": [{"role": "user", "content": PROMPT.format(a=a, b=b)},
                              {"role": "assistant", "content": worked_answer(a, b)}]} for a, b in pairs[:SFT_ROWS]],
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
