"""examples/math's data (docs/examples.md's worked example): the committed files are what its
generator writes, and no held-out sum was trained on by SFT."""

import importlib.util
import re
import sys

from tests.documented import ROOT

FOLDER = ROOT / "examples" / "math"


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
    rows = make_data().rows()
    question = re.compile(r"What is (\d+) \+ (\d+)\?")
    sft = {question.match(r["messages"][0]["content"]).groups() for r in rows["sft"]}
    sums = {question.match(r["prompt"]).groups() for r in rows["sums"]}
    assert not sft & sums and len(sft) + len(sums) == 90 * 90
    for row in rows["sft"]:
        a, b = map(int, question.match(row["messages"][0]["content"]).groups())
        assert row["messages"][1]["content"].endswith(f"\\boxed{{{a + b}}}"), row
    assert all(r["answer"] == str(sum(map(int, question.match(r["prompt"]).groups()))) for r in rows["sums"])
