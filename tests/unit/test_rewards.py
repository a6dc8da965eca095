"""The reward menu (fleetrl.envs.rewards): each reward, a user's `module:function`, the math
reward off the main thread and in worker processes killed past its time limit, and every bad
spec's one-line error."""

import asyncio
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from fleetrl.envs import EnvError
from fleetrl.envs.rewards import _MATH_WORKERS, MATH_WORKERS, MENU, resolve_reward
from fleetrl.orchestrator.threads import call_user_code


def test_exact_and_contains_compare_the_stripped_answer():
    exact, contains = resolve_reward("exact"), resolve_reward("contains")
    assert exact("  42\n", 42) == 1.0 and exact("42.", "42") == 0.0
    assert contains("so it is 42, I think", " 42 ") == 1.0 and contains("41", "42") == 0.0
    assert contains("anything", "") == 0.0  # an empty answer is in every text, and so proves nothing


def test_an_integral_float_answer_is_compared_as_the_integer():
    # A JSON column holding 7 beside 2.5 loads 7 as 7.0.
    assert resolve_reward("exact")("7", 7.0) == 1.0 and resolve_reward("exact")("2.5", 2.5) == 1.0
    assert resolve_reward("contains")("it is 7", 7.0) == 1.0
    assert resolve_reward("regex", pattern=r"= (\S+)")("x = 7", 7.0) == 1.0


def test_regex_compares_its_group_in_the_last_match():
    reward = resolve_reward("regex", pattern=r"<answer>(.*?)</answer>")
    assert reward("<answer>3</answer> no, <answer> 7 </answer>", 7) == 1.0
    assert reward("<answer>7</answer> no, <answer>3</answer>", 7) == 0.0
    assert reward("7", 7) == 0.0


@pytest.mark.parametrize("completion, answer, expected", [
    ("The answer is 42.", 42, 1.0),                       # plain
    ("So the result is \\boxed{42}", "42", 1.0),          # boxed
    ("$\\frac{1}{2}$", "0.5", 1.0),                       # LaTeX against plain
    ("so \\boxed{1/2}", "\\boxed{\\frac{1}{2}}", 1.0),    # boxed on both sides
    ("It is $x + 1$", "1+x", 1.0),                        # a bare expression answer
    ("\\boxed{\\sqrt 2}", "\\sqrt{2}", 1.0),
    ("I think 42, no wait, 43", "42", 0.0),               # the last answer given counts
    ("The answer is 41.", 42, 0.0),
    ("", 42, 0.0),
])
def test_math_compares_answers_as_mathematics(completion, answer, expected):
    assert resolve_reward("math")(completion, answer) == expected


def test_math_works_off_the_main_thread_as_the_orchestrator_calls_it():
    # math-verify's default time limits use signal.alarm, which raises outside the main thread.
    reward = resolve_reward("math")
    scored = asyncio.run(call_user_code("reward", 60, "orchestrator.reward_timeout_s", reward,
                                        "\\boxed{\\frac12}", "0.5"))
    assert scored == 1.0


BOMB = "\\boxed{9^{9^{9^{9}}}}"  # sympy's big integers for ever, holding the GIL


def workers() -> set[int]:
    return {p.pid for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE}


def test_math_kills_a_parse_past_its_time_limit_and_goes_on():
    reward = resolve_reward("math", timeout_s=1)
    # Children this test did not start (an earlier test's call still running in a thread it left).
    others = workers() - {w.pid for w in _MATH_WORKERS._idle}
    with pytest.raises(RuntimeError, match=r"^math-verify took longer than timeout_s = 1 s \(its process was killed\)$"):
        reward(BOMB, "3")
    assert reward("\\boxed{3}", "3") == 1.0
    # The killed one is gone, not left behind.
    assert workers() - others == {w.pid for w in _MATH_WORKERS._idle}
    # As the orchestrator calls it: the call fails (reward_failed), and the loop was never starved.
    with pytest.raises(EnvError, match=r"^reward raised RuntimeError: math-verify took longer than timeout_s = 1 s"):
        asyncio.run(call_user_code("reward", 30, "orchestrator.reward_timeout_s", reward, BOMB, "3"))


def test_math_from_many_threads_at_once():
    reward = resolve_reward("math")
    others = workers() - {w.pid for w in _MATH_WORKERS._idle}  # children an earlier test left
    cases = [(f"\\boxed{{{n}/2}}", str(n / 2), 1.0) for n in range(12)] + [("\\boxed{5}", "4", 0.0)] * 4
    with ThreadPoolExecutor(8) as pool:
        scored = list(pool.map(lambda case: reward(case[0], case[1]), cases))
    assert scored == [expected for _, _, expected in cases]
    idle = {w.pid for w in _MATH_WORKERS._idle}
    assert workers() - others == idle and len(idle) <= MATH_WORKERS


def test_a_math_worker_dies_with_fleetrl_and_outlives_the_thread_that_asked():
    script = (f"import threading\nfrom fleetrl.envs import rewards\n"
              f"t = threading.Thread(target=rewards.math_equal, args=('1', '1')); t.start(); t.join()\n"
              f"print(rewards._MATH_WORKERS._idle[0].pid, flush=True)\n"
              f"rewards.math_equal({BOMB!r}, '3', timeout_s=600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(parent.stdout.readline()))
        assert worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
        # Part of fleetrl, in its process group: not a server that leads a group of its own (the
        # kill-points and chaos runs hold fleetrl's only group-leading child to be trainer rank 1).
        assert os.getpgid(worker.pid) == os.getpgid(parent.pid)
    finally:
        parent.kill()
        parent.wait()
    while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:  # the kernel's SIGKILL, at once
        time.sleep(0.05)


def test_math_refuses_an_answer_it_cannot_parse():
    with pytest.raises(ValueError, match="cannot parse the answer ''"):
        resolve_reward("math")("42", "")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `my_rewards` in the current directory, as a user's beside their config."""
    (tmp_path / "my_rewards.py").write_text(
        "def short(completion, answer, limit=5):\n    return float(len(completion) <= limit)\n\nLIMIT = 5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("my_rewards", None)


def test_a_user_function_takes_the_same_arguments_and_its_options(user_module):
    assert resolve_reward("my_rewards:short")("123456", None) == 0.0
    assert resolve_reward("my_rewards:short", limit=10)("123456", None) == 1.0


@pytest.mark.parametrize("spec, options, error", [
    ("nope", {}, f"unknown reward 'nope' (the menu: {', '.join(MENU)}; or module.path:function)"),
    ("exact", {"pattern": "x"},
     "reward exact: got an unexpected keyword argument 'pattern' (it takes completion, answer)"),
    ("regex", {}, "reward regex: missing a required argument: 'pattern' (it takes completion, answer, pattern)"),
    ("regex", {"pattern": "(a)(b)"}, "reward regex: pattern '(a)(b)' has 2 groups; it needs exactly one, the answer"),
    ("regex", {"pattern": "(("}, "reward regex: pattern '((' is not a regular expression (missing ), unterminated "
                                 "subpattern at position 1)"),
    ("my_rewards:short", {"limt": 3}, "reward my_rewards:short: got an unexpected keyword argument 'limt' (it takes "
                                      "completion, answer, limit=5)"),
    ("my_rewards:long", {}, "reward my_rewards:long: module 'my_rewards' ("),
    ("no_such_module:fn", {}, "reward no_such_module:fn: cannot import module 'no_such_module'"),
    ("math", {"timeout_s": 0}, "reward math: timeout_s = 0 is not a positive number of seconds"),
    ("math", {"timeout_s": "5"}, "reward math: timeout_s = '5' is not a positive number of seconds"),
])
def test_a_bad_spec_is_one_line(user_module, spec, options, error):
    with pytest.raises(EnvError) as raised:
        resolve_reward(spec, **options)
    assert str(raised.value).startswith(error) and "\n" not in str(raised.value)
