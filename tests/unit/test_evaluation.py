"""Evaluation during training (orchestrator/evaluation.py) against the in-process fake fleet, and
the built-in environments' held-out split."""

import itertools
import json
import math
import statistics

import pytest

from fleetrl.config import EvalConfig
from fleetrl.envs import EnvError, get_environment
from fleetrl.envs.base import eval_stream, held_out
from fleetrl.envs.mix import RunEnv
from fleetrl.orchestrator.evaluation import Evaluator, pass_at_k, standard_error
from fleetrl.records import EvalLine
from fleetrl.rundir import VerifyError, check_eval

from .test_orchestrator import Env, make


def test_the_standard_error_is_the_sample_standard_deviation_over_root_n():
    assert standard_error([0.0, 1.0]) == pytest.approx(math.sqrt(0.5) / math.sqrt(2))  # 0.5
    assert standard_error([0.2, 0.4, 0.9]) == pytest.approx(statistics.stdev([0.2, 0.4, 0.9]) / math.sqrt(3))
    assert standard_error([0.7]) is None and standard_error([]) is None


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(4, 3, 2) == 1.0  # any 2 of 4 hold a pass


@pytest.mark.parametrize("name", ["reverse_text", "arithmetic", "arithmetic_retry", "calculator"])
def test_the_built_in_held_out_split_is_never_trained_on(name):
    env = get_environment(name)
    trained = list(itertools.islice(env.tasks(0), 900))
    held = list(itertools.islice(eval_stream(env, 0, held_out_only=True), 100))
    assert not any(held_out(task) for task in trained) and all(held_out(task) for task in held)
    contents = lambda tasks: {json.dumps(t.messages) for t in tasks}  # noqa: E731
    assert not contents(trained) & contents(held)
    assert list(itertools.islice(env.tasks(0), 5)) == trained[:5]  # the same seed, the same stream


def test_an_environment_without_a_held_out_split_is_evaluated_only_when_named():
    with pytest.raises(EnvError, match=r"env fake has no held-out split \(eval_tasks\): name .* eval\.envs"):
        eval_stream(Env(), 0, held_out_only=True)
    assert next(eval_stream(Env(), 0, held_out_only=False)).id == "t0-0"


async def test_an_evaluation_scores_every_prompt_at_one_version_and_records_it():
    fleet, orch, _ = await make()
    config = EvalConfig(every_steps=1, prompts=3, samples_per_prompt=4, greedy=False, pass_reward=0.5)
    rewards = itertools.cycle([1.0, 0.0, 0.0, 0.0])  # one pass in four, per prompt
    evaluator = Evaluator(orch, [RunEnv("fake", Env(lambda rollout: next(rewards)))], config, seed=0,
                          held_out_only=False, run_dir=orch.run_dir, last_step=3, log=lambda *_: None)
    figures = await evaluator.evaluate(fleet.version)
    assert {name: f.to_dict() for name, f in figures.items()} == {"fake": {"prompts": 3, "samples": 12, "failed": 0, "reward_mean": 0.25, "reward_se": 0.0,
                                "pass@1": pytest.approx(0.25), "pass@4": 1.0}}
    records = [json.loads(line) for line in orch.run_dir.eval_records_path(0).read_text().splitlines()]
    assert len(records) == 12 and {r["task"] for r in records} == {"fake/t0-0", "fake/t0-1", "fake/t0-2"}
    assert all(r["spans"] == [[0, 0]] for r in records)
    (line,) = orch.run_dir.read_evals()
    assert line.version == 0 and line.envs == figures
    check_eval(orch.run_dir, 0)
    # A token of another version in an evaluation's records is what `fleetrl verify` refuses.
    records[5]["spans"] = [[0, 0], [1, 3]]
    orch.run_dir.eval_records_path(0).write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(VerifyError, match=r"the evaluation of v0: sample 5 \(fake/t0-1\) holds tokens of versions \[0, 1\]"):
        check_eval(orch.run_dir, 0)
    await fleet.close()


async def test_the_versions_evaluated_are_the_start_every_nth_and_the_last_each_once():
    """every_steps = 2 of 5 steps, resumed after step 2, whose run had evaluated v0 and v2: the
    start version (v2) stands, v4 and v5 are due, v1 and v3 are not."""
    fleet, orch, _ = await make()
    for version in (0, 2):
        orch.run_dir.write_eval([], EvalLine(version=version, started=0.0, seconds=1.0, envs={}))
    evaluator = Evaluator(orch, [RunEnv("fake", Env())], EvalConfig(every_steps=2, prompts=1), seed=0,
                          held_out_only=False, run_dir=orch.run_dir, last_step=5, log=lambda *_: None)
    assert not evaluator.due(2, start=True)
    assert [v for v in range(1, 6) if evaluator.due(v)] == [4, 5]
    await evaluator.evaluate(4)
    assert not evaluator.due(4)  # once
    fresh = Evaluator(orch, [RunEnv("fake", Env())], EvalConfig(every_steps=2, prompts=1), seed=0,
                      held_out_only=False, run_dir=orch.run_dir, last_step=5, log=lambda *_: None)
    assert fresh.due(3, start=True) and not fresh.due(4)  # what eval.jsonl holds stands
    await fleet.close()


def test_greedy_evaluation_takes_one_sample_per_prompt():
    from fleetrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"eval\.samples_per_prompt = 4 needs eval\.greedy = false"):
        load_config([], [("eval.samples_per_prompt", "4")])
