"""calculator: two-digit products and sums, with a calculator tool. A tool-use task.

The model may call `calculator` (Hermes tool-call format, `envs/tools.py`) and reads its result
back as a tool message; the episode ends at the first turn without a tool call, whose
`<answer>N</answer>` is scored like arithmetic's:

    reward = FORMAT_WEIGHT  * [the last turn holds exactly one <answer>N</answer>, N an integer]
           + CORRECT_WEIGHT * [that N is the right result]

Products of two two-digit numbers are beyond what SmolLM2-135M-Instruct computes in its head
(it is right on few of them), and exact with the tool, so the reward rises as the model learns
to call it and to copy its result. Three worked examples open the conversation: without one
the model does not know the call's shape, and with one SmolLM2-135M-Instruct mostly answers
without the tool.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Iterator

from fleetrl.envs.arithmetic import CORRECT_WEIGHT, FORMAT_WEIGHT, parse_answer
from fleetrl.envs.base import HeldOutSplit, Rollout, Task
from fleetrl.envs.tools import Tool

SYSTEM = ("You can use a calculator. To use it, reply with only "
          '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call> '
          "and you will get the result. Then give the final result as <answer>N</answer>.")
PROMPT = "What is {a} {op} {b}?"
EXAMPLES = [{"role": "system", "content": SYSTEM}]
for a, op, b in ((23, "*", 41), (58, "+", 67), (12, "*", 85)):  # worked examples: call, result, answer
    EXAMPLES += [
        {"role": "user", "content": PROMPT.format(a=a, op=op, b=b)},
        {"role": "assistant",
         "content": f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} {op} {b}"}}}}</tool_call>'},
        {"role": "tool", "content": str(a * b if op == "*" else a + b)},
        {"role": "assistant", "content": f"<answer>{a * b if op == '*' else a + b}</answer>"},
    ]
OPERATORS = {"+": operator.add, "*": operator.mul}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (+ - * / and parentheses over numbers), or what is
    wrong with it: a bad expression is the model's mistake, answered, not raised."""
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if value == int(value) else f"{value:.6g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("only numbers, + - * / and parentheses")


CALCULATOR = Tool(
    name="calculator", fn=calculate, description="Evaluates an arithmetic expression (+ - * / and parentheses).",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    timeout_s=5.0,
)


class Calculator(HeldOutSplit):
    name = "calculator"
    tools = [CALCULATOR]

    def __init__(self, min_operand: int = 10, max_operand: int = 99, ops: str = "*+") -> None:
        if not 0 <= min_operand <= max_operand:
            raise ValueError(f"need 0 <= min_operand <= max_operand, got {min_operand} and {max_operand}")
        if not ops or set(ops) - set(OPERATORS):
            raise ValueError(f"ops must be a non-empty string of {''.join(OPERATORS)}, got {ops!r}")
        self.min_operand, self.max_operand, self.ops = min_operand, max_operand, ops

    def generate(self, seed: int) -> Iterator[Task]:
        rng = random.Random(seed)
        index = 0
        while True:
            a, b = (rng.randint(self.min_operand, self.max_operand) for _ in range(2))
            op = rng.choice(self.ops)
            yield Task(id=f"{seed}-{index}", messages=[*EXAMPLES, {"role": "user", "content": PROMPT.format(a=a, op=op, b=b)}],
                       answer=OPERATORS[op](a, b))
            index += 1

    def respond(self, task: Task, messages: list[dict[str, str]], state: dict) -> list[dict[str, str]] | None:
        return None  # a turn without a tool call is the final answer

    def reward(self, rollout: Rollout) -> float:
        answer = parse_answer(rollout.completion)
        if answer is None:
            return 0.0
        return FORMAT_WEIGHT + CORRECT_WEIGHT * (answer == rollout.task.answer)
