"""Built-in environments and the environment contract (hermetic: no model, no verifiers)."""

import itertools
import math
import sys

import pytest

from fleetrl.envs import EnvError, Rollout, Task, get_environment, respond, score, task_stream
from fleetrl.envs import arithmetic_retry
from fleetrl.envs.arithmetic import CORRECT_WEIGHT, FORMAT_WEIGHT
from fleetrl.envs.calculator import CALCULATOR, calculate
from fleetrl.envs.tools import ToolCall, parse_tool_calls
from fleetrl.envs.reverse_text import levenshtein, similarity
from fleetrl.versions import VersionSpan


def rollout(task, completion):
    return Rollout(task=task, completion=completion, spans=[VersionSpan(0, 0)], step=1)


def take(env, seed, n=50):
    return list(itertools.islice(task_stream(env, seed), n))


@pytest.mark.parametrize("name", ["reverse_text", "arithmetic", "arithmetic_retry", "calculator"])
def test_task_streams_are_endless_and_reproducible_per_seed(name):
    env = get_environment(name)
    first = take(env, seed=7)
    assert first == take(get_environment(name), seed=7)  # a fresh env, the same seed: the same tasks
    assert first != take(env, seed=8)
    assert len({t.id for t in first}) == len(first)
    assert len(take(env, seed=7, n=5000)) == 5000
    for task in first:
        assert task.messages[-1]["role"] == "user" and task.messages[-1]["content"]


def test_reverse_text_rewards_the_reversed_text():
    env = get_environment("reverse_text")
    for task in take(env, seed=0, n=20):
        text = task.messages[-1]["content"].rsplit("Text: ", 1)[1]
        assert 3 <= len(text) <= 5 and text.isalpha()
        assert task.answer == text[::-1]
        assert score(env, rollout(task, text[::-1])) == 1.0
        # Formatting around the answer does not count against it.
        assert score(env, rollout(task, f'  "{text[::-1].capitalize()}"\n')) == 1.0
        assert score(env, rollout(task, "")) == 0.0
        assert score(env, rollout(task, "Sure! Here is the reversed text you asked for: 12")) < 0.1


def test_reverse_text_gives_partial_credit_for_near_misses():
    task = Task(id="t", messages=[], answer="olleh")
    env = get_environment("reverse_text")
    assert score(env, rollout(task, "olleh")) == 1.0
    assert score(env, rollout(task, "ollex")) == pytest.approx(0.8)
    assert score(env, rollout(task, "hello")) == pytest.approx(0.2)  # echoing is not reversing
    assert levenshtein("kitten", "sitting") == 3
    assert similarity("", "") == 1.0


def test_reverse_text_length_options():
    env = get_environment("reverse_text", min_len=8, max_len=8)
    assert all(len(t.answer) == 8 for t in take(env, seed=1))


def test_arithmetic_tasks_and_answers():
    env = get_environment("arithmetic", max_operand=9)
    for task in take(env, seed=0, n=200):
        question = task.messages[-1]["content"].removeprefix("What is ").split("?")[0]
        a, op, b = question.split()
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9 and op in "+-*"
        assert task.answer == eval(question)  # noqa: S307 - two small integers and an operator


def test_arithmetic_reward_has_a_format_part_and_a_correctness_part():
    env = get_environment("arithmetic")
    task = Task(id="t", messages=[], answer=-6)
    assert FORMAT_WEIGHT + CORRECT_WEIGHT == 1.0
    assert score(env, rollout(task, "3 - 9 = -6. <answer>-6</answer>")) == 1.0
    assert score(env, rollout(task, "<answer> -6 </answer>")) == 1.0
    assert score(env, rollout(task, "<answer>6</answer>")) == FORMAT_WEIGHT  # checkable, wrong
    assert score(env, rollout(task, "The answer is -6.")) == 0.0  # right, but not checkable
    assert score(env, rollout(task, "<answer>minus six</answer>")) == 0.0
    assert score(env, rollout(task, "<answer>-6</answer> or <answer>6</answer>")) == 0.0  # no hedging
    assert score(env, rollout(task, "asdf qwer")) == 0.0


def test_arithmetic_ops_option():
    env = get_environment("arithmetic", ops="*")
    assert all(" * " in t.messages[-1]["content"] for t in take(env, seed=3))


class Stub:
    """An environment whose reward function misbehaves in a chosen way."""

    name = "stub"

    def __init__(self, reward):
        self._reward = reward

    def tasks(self, seed):
        for i in itertools.count():
            if i == 2:
                raise KeyError("row 2 is missing")
            yield Task(id=f"{seed}-{i}", messages=[{"role": "user", "content": "hi"}], answer=None)

    def reward(self, rollout):
        return self._reward()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (math.nan, r"is nan, outside \[0, 1\]"),
        (math.inf, r"is inf, outside \[0, 1\]"),
        (-0.1, r"is -0.1, outside \[0, 1\]"),
        (1.5, r"is 1.5, outside \[0, 1\]"),
        (None, r"is None, not a number"),
        ("0.5", r"is '0.5', not a number"),
        (b"1", r"is b'1', not a number"),
    ],
)
def test_unusable_rewards_become_env_errors_naming_env_and_task(value, message):
    env = Stub(lambda: value)
    task = next(env.tasks(0))
    with pytest.raises(EnvError, match=rf"^env stub: reward of task 0-0 {message}$"):
        score(env, rollout(task, "x"))


def test_a_raising_reward_becomes_an_env_error():
    def boom():
        raise ZeroDivisionError("division by zero\nmore detail")

    env = Stub(boom)
    with pytest.raises(EnvError, match=r"^env stub: reward of task 0-0 raised ZeroDivisionError: division by zero$"):
        score(env, rollout(next(env.tasks(0)), "x"))


def test_rewards_at_the_bounds_and_numpy_like_numbers_are_fine():
    env = Stub(lambda: True)
    assert score(env, rollout(next(env.tasks(0)), "x")) == 1.0
    assert score(Stub(lambda: 0), rollout(next(env.tasks(0)), "x")) == 0.0


def test_a_raising_task_stream_becomes_an_env_error():
    stream = task_stream(Stub(lambda: 0.5), seed=4)
    assert [next(stream).id, next(stream).id] == ["4-0", "4-1"]
    error = r"^env stub: generating task 2 \(seed 4\) raised KeyError: 'row 2 is missing'$"
    with pytest.raises(EnvError, match=error):
        next(stream)


def test_unknown_environment_lists_the_known_ones():
    with pytest.raises(EnvError, match=r"^unknown environment 'revers_text' \(built-in: reverse_text, arithmetic, "
                                       r"arithmetic_retry, calculator.*; registered: .*; or module.path:Attr, "
                                       r"verifiers:<taskset id>.*\)$"):
        get_environment("revers_text")


def test_bad_options_name_the_env_and_the_option():
    with pytest.raises(EnvError, match=r"^env arithmetic: unknown option 'max_operands' \(accepted: max_operand, ops"):
        get_environment("arithmetic", max_operands=5)
    with pytest.raises(EnvError, match=r"^env arithmetic: ops must be a non-empty string of \+-\*, got '/'$"):
        get_environment("arithmetic", ops="/")
    with pytest.raises(EnvError, match=r"^env reverse_text: need 1 <= min_len <= max_len, got 5 and 2$"):
        get_environment("reverse_text", min_len=5, max_len=2)


def test_verifiers_envs_without_verifiers_installed_say_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # find_spec reports it missing
    with pytest.raises(EnvError, match=r"^verifiers environments need the .verifiers. package, which scripts/setup.sh "
                                       r"installs: pip install -e .\.\[verifiers\].$"):
        get_environment("verifiers:reverse-text")


def conversation(task, *turns):
    """The task's messages, then model turns and the environment's answers in turn."""
    roles = itertools.cycle(["assistant", "user"])
    return [*task.messages, *({"role": next(roles), "content": text} for text in turns)]


def test_arithmetic_retry_answers_until_right_and_rewards_being_right_sooner():
    env = get_environment("arithmetic_retry")
    task = take(env, seed=0, n=1)[0]
    right, wrong = f"<answer>{task.answer}</answer>", f"<answer>{task.answer + 1}</answer>"
    assert env.respond(task, conversation(task, right), {}) is None
    assert env.respond(task, conversation(task, wrong), {}) == [{"role": "user", "content": arithmetic_retry.WRONG}]
    assert env.respond(task, conversation(task, "12"), {}) == [{"role": "user", "content": arithmetic_retry.UNREADABLE}]
    messages = conversation(task, wrong, arithmetic_retry.WRONG, "no idea", arithmetic_retry.UNREADABLE, right)
    assert score(env, Rollout(task, right, [VersionSpan(0, 0)], 1, messages)) == pytest.approx(1 / 3)
    assert score(env, Rollout(task, right, [VersionSpan(0, 0)], 1, conversation(task, right))) == 1.0
    assert score(env, Rollout(task, wrong, [VersionSpan(0, 0)], 1, conversation(task, wrong))) == arithmetic_retry.FORMAT_WEIGHT
    assert score(env, Rollout(task, "?", [VersionSpan(0, 0)], 1, conversation(task, "?"))) == 0.0


def test_the_calculator_tool_evaluates_arithmetic_and_answers_bad_expressions():
    assert calculate("23 * 41") == "943" and calculate("(1 + 2) * -3") == "-9" and calculate("7 / 2") == "3.5"
    assert calculate("1 / 0") == "error: division by zero"
    assert calculate("__import__('os')") == "error: only numbers, + - * / and parentheses"
    assert calculate("2 +") .startswith("error: ")


def test_calculator_scores_the_final_answer():
    env = get_environment("calculator")
    task = take(env, seed=3, n=1)[0]
    assert [tool.name for tool in env.tools] == ["calculator"] and env.respond(task, task.messages, {}) is None
    assert score(env, rollout(task, f"<answer>{task.answer}</answer>")) == FORMAT_WEIGHT + CORRECT_WEIGHT
    assert score(env, rollout(task, "<answer>0</answer>")) == FORMAT_WEIGHT
    assert score(env, rollout(task, "I do not know")) == 0.0


def test_tool_calls_are_read_in_order_and_badly_written_ones_say_why():
    tools = {"calculator": CALCULATOR}
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call> and '
            '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
            "<tool_call>not json</tool_call>"
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>')
    calls = parse_tool_calls(text, tools)
    assert calls[0] == ToolCall("calculator", {"expression": "1+1"})
    assert [c.error for c in calls[1:]] == [
        "bad arguments for calculator: missing a required argument: 'expression'",
        "the tool call is not JSON (Expecting value)",
        "no tool named 'search' (tools: calculator)",
        "the arguments of calculator are not a JSON object",
    ]
    assert parse_tool_calls("no call here", tools) == []


def test_an_environment_answer_must_be_none_or_messages():
    env = get_environment("arithmetic_retry")
    task = take(env, seed=0, n=1)[0]
    env.respond = lambda task, messages, state: [{"role": "user"}]
    with pytest.raises(EnvError, match="^env arithmetic_retry: answer to turn 1 of task 0-0 is .* not None or a non-empty"):
        respond(env, task, conversation(task, "x"), {})
    env.respond = lambda task, messages, state: 1 / 0
    with pytest.raises(EnvError, match="^env arithmetic_retry: answer to turn 1 of task 0-0 raised ZeroDivisionError"):
        respond(env, task, conversation(task, "x"), {})


def test_a_seek_draws_what_skipping_would_for_the_dataset_and_a_mix_with_a_built_in(tmp_path):
    from fleetrl.envs.mix import RunEnv, run_task_stream

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(5)))
    dataset = get_environment("dataset", path=str(path), reward="exact", eval_fraction=0.2)
    whole = list(itertools.islice(task_stream(dataset, 3), 30))  # 4 training rows a pass: passes 0..7
    for start in (1, 4, 9, 26):
        assert list(itertools.islice(dataset.tasks_from(3, start), 30 - start)) == whole[start:]
    # arithmetic has no tasks_from: its stream is generated and skipped, the dataset's sought.
    envs = [RunEnv("rows", dataset), RunEnv("arith", get_environment("arithmetic"), weight=2.0)]
    skipped = list(itertools.islice(run_task_stream(envs, seed=3), 40, 70))
    sought = list(itertools.islice(run_task_stream(envs, seed=3, start=40), 30))
    assert [(d.id, d.task) for d in sought] == [(d.id, d.task) for d in skipped]
    assert {d.env.name for d in sought} == {"rows", "arith"}
