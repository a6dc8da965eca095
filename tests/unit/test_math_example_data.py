"""examples/math's data (docs/examples.md's worked example): the committed files are what its
generator writes, no held-out sum was trained on by SFT, and the reasoning-gym conversations
are prompted exactly as rl.toml's reasoning-gym environment prompts, none of them held out."""

import importlib.util
import itertools
import re
import sys
import tomllib

import pytest

from fleetrl.envs.base import Task, held_out
from tests.documented import ROOT

pytest.importorskip("reasoning_gym")

FOLDER = ROOT / "examples" / "math"
BOXED_QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


def make_data():
    spec = importlib.util.spec_from_file_location("make_data", FOLDER / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_files_are_the_generators_output(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["make_data.py", str(tmp_path)])
    make_data().main()
    for name in ("sft.jsonl", "sums.jsonl"):
        assert (tmp_path / name).read_text() == (FOLDER / name).read_text(), name


def test_sft_and_rl_take_disjoint_sums_and_each_worked_answer_is_right():
    module = make_data()
    rows = module.rows()
    boxed = rows["sft"][:module.SFT_ROWS]
    sft = {BOXED_QUESTION.match(r["messages"][0]["content"]).groups() for r in boxed}
    sums = {BOXED_QUESTION.match(r["prompt"]).groups() for r in rows["sums"]}
    assert not sft & sums and len(sft) + len(sums) == 90 * 90
    for row in boxed:
        a, b = map(int, BOXED_QUESTION.match(row["messages"][0]["content"]).groups())
        assert row["messages"][1]["content"].endswith(f"\\boxed{{{a + b}}}"), row
    assert all(r["answer"] == str(sum(map(int, BOXED_QUESTION.match(r["prompt"]).groups()))) for r in rows["sums"])


def test_the_reasoning_gym_conversations_are_rl_tomls_prompts_none_held_out():
    from fleetrl.envs.reasoning_gym import ReasoningGymEnvironment

    module = make_data()
    rows = module.rows()
    gym = rows["sft"][module.SFT_ROWS:]
    (entry,) = [e for e in tomllib.loads((FOLDER / "rl.toml").read_text())["orchestrator"]["envs"]
                if e["env"].startswith("reasoning_gym:")]
    assert entry["env"] == f"reasoning_gym:{module.GYM_DATASET}" and entry["options"] == module.GYM_OPTIONS
    env = ReasoningGymEnvironment(module.GYM_DATASET, **entry["options"])
    evaluated = [task.messages for task in itertools.islice(env.eval_tasks(0), 64)]  # run.seed 0's first
    system = evaluated[0][0]
    boxed_pairs = {tuple(map(int, BOXED_QUESTION.match(r["messages"][0]["content"]).groups()))
                   for r in rows["sft"][:module.SFT_ROWS]}
    assert len(gym) == module.GYM_ROWS
    for row in gym:
        prompt, answer = row["messages"][:2], row["messages"][2]["content"]
        assert prompt[0] == system and not held_out(Task("", prompt, None)), row
        assert prompt not in evaluated, row
        a, b = map(int, module.GYM_QUESTION.fullmatch(prompt[1]["content"]).groups())
        assert (a, b) in boxed_pairs and answer.endswith(f"<answer>{a + b}</answer>"), row
