"""`reasoning_gym:<dataset>` (fleetrl/envs/reasoning_gym.py) on the installed reasoning-gym
library, offline: exact task streams per seed, the dataset's config as options, one-line errors,
the dataset's own scorer as the reward, a held-out split, a resume's seek, a mix of two, and a
build off the main thread with the tripwire armed."""

from __future__ import annotations

import itertools
import threading

import pytest

from fleetrl import tripwire
from fleetrl.config import ConfigError, load_config
from fleetrl.envs import EnvError, Rollout, get_environment, score, task_stream
from fleetrl.envs.base import held_out
from fleetrl.envs.mix import run_task_stream
from fleetrl.versions import VersionSpan

pytest.importorskip("reasoning_gym")

ARITH = "reasoning_gym:basic_arithmetic"


def take(stream, n):
    return list(itertools.islice(stream, n))


def rollout(task, completion):
    return Rollout(task=task, completion=completion, spans=[VersionSpan(0, 0)], step=1)


def test_the_same_seed_gives_the_same_tasks_across_chunks():
    env = get_environment(ARITH, size=7)  # several chunks of 7 entries in 30 tasks
    first = take(task_stream(env, 3), 30)
    assert first == take(task_stream(get_environment(ARITH, size=7), 3), 30)
    assert first != take(task_stream(env, 4), 30)
    assert len({t.id for t in first}) == 30
    assert all(t.id.startswith("3-") for t in first)
    # The chunks' seeds are hashed: no chunk repeats its neighbour's entries shifted by one.
    assert len({t.messages[-1]["content"] for t in first}) == 30
    system, user = first[0].messages
    assert system["role"] == "system" and "<answer>" in system["content"]
    assert user == {"role": "user", "content": first[0].answer["question"]}


def test_options_are_the_dataset_config():
    env = get_environment(ARITH, min_terms=2, max_terms=2, max_digits=1, operators=["+"], allow_parentheses=False)
    for task in take(task_stream(env, 0), 20):
        terms = task.answer["metadata"]["expression"].split(" + ")
        assert len(terms) == 2 and all(0 <= int(term) <= 10 for term in terms)


@pytest.mark.parametrize(("name", "options", "message"), [
    (ARITH, {"max_term": 3},
     "env reasoning_gym:basic_arithmetic: unknown option 'max_term' (the dataset's config fields: min_terms, "
     "max_terms, min_digits, max_digits, operators, allow_parentheses, allow_negation, size, format_style, "
     "whitespace)"),
    (ARITH, {"seed": 1}, "env reasoning_gym:basic_arithmetic: option 'seed': the run's seed (run.seed) seeds the tasks"),
    (ARITH, {"min_terms": 0}, "env reasoning_gym:basic_arithmetic: options {'min_terms': 0}: AssertionError: "
                              "min_terms must be positive"),
    (ARITH, {"size": 0}, "env reasoning_gym:basic_arithmetic: option 'size' must be an integer >= 1, got 0"),
    ("reasoning_gym:basic_arithmetc", {}, "env reasoning_gym:basic_arithmetc: reasoning_gym has no dataset "
                                          "'basic_arithmetc' (close: basic_arithmetic"),
    ("reasoning_gym:composite", {}, "mix reasoning_gym datasets with [[orchestrator.envs]] instead"),
    ("reasoning_gym:codeio", {}, "env reasoning_gym:codeio: not supported: its tasks depend on Python's global "
                                 "random state"),
    ("reasoning_gym:list_functions", {}, "not supported: the same seed gives different tasks even within one"),
])
def test_bad_options_and_names_get_one_line(name, options, message):
    with pytest.raises(EnvError) as caught:
        get_environment(name, **options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_reward_is_the_datasets_score_of_the_tagged_answer():
    env = get_environment(ARITH)
    task = take(task_stream(env, 0), 1)[0]
    right = task.answer["answer"]
    assert score(env, rollout(task, f"Let me think.\n<answer>{right}</answer>")) == 1.0
    assert score(env, rollout(task, "<answer>twelve</answer>")) == 0.0
    # The dataset's own partial credit: an answer that contains the right one.
    assert score(env, rollout(task, f"<answer>{right}1</answer>")) == pytest.approx(len(right) / (len(right) + 1))
    assert score(env, rollout(task, right)) == 0.0  # no tags: no answer


def test_a_scorer_that_cannot_parse_the_answer_scores_it_zero_and_overshoots_are_clamped():
    factors = get_environment("reasoning_gym:prime_factorization")
    task = take(task_stream(factors, 0), 1)[0]
    assert score(factors, rollout(task, "<answer>zzz</answer>")) == 0.0  # its scorer raises ValueError
    backward = get_environment("reasoning_gym:spell_backward")
    rewards = [score(backward, rollout(t, f"<answer>{t.answer['answer']}</answer>"))
               for t in take(task_stream(backward, 0), 50)]
    assert rewards == [1.0] * 50  # its scorer gives some right answers 1.0000000000000002
    nan = get_environment(ARITH)
    nan._scorer.score_answer = lambda answer, entry: float("nan")
    assert score(nan, rollout(take(task_stream(nan, 0), 1)[0], "<answer>1</answer>")) == 0.0


def test_the_held_out_split_is_disjoint_from_training():
    env = get_environment(ARITH, max_terms=2, max_digits=1, operators=["+"])  # a small space: questions repeat
    train = take(task_stream(env, 0), 500)
    held = take(task_stream(env, 0, split="eval_tasks"), 20)
    assert not any(held_out(t) for t in train) and all(held_out(t) for t in held)
    assert not {t.messages[-1]["content"] for t in held} & {t.messages[-1]["content"] for t in train}


def test_a_resume_seeks_to_its_chunk_and_draws_what_skipping_would(monkeypatch):
    # A small space: about one entry in ten is held out and replaced, some replacements too.
    env = get_environment(ARITH, max_terms=2, max_digits=1, operators=["+"], size=7)
    made = []
    chunk = env._chunk
    monkeypatch.setattr(env, "_chunk", lambda seed, c, replacement=0: made.append(c) or chunk(seed, c, replacement))
    whole = take(task_stream(env, 3), 120)
    assert any("r" in t.id for t in whole) and not any(held_out(t) for t in whole)
    for start in (1, 7, 52, 100):
        made.clear()
        assert take(task_stream(env, 3, start=start), 20) == whole[start:start + 20]
        assert min(made) == start // 7  # no chunk before `start`'s is created


def test_two_datasets_mix_through_orchestrator_envs_deterministically():
    from fleetrl.app.checks import run_environments
    from fleetrl.rundir import RunDir

    entries = ('[{name = "sum", env = "reasoning_gym:basic_arithmetic", options = {max_terms = 2}, weight = 2}, '
               '{name = "letters", env = "reasoning_gym:letter_counting"}]')
    config = load_config([], [("orchestrator.envs", entries)])

    def drawn():
        envs = run_environments(config, RunDir(config.run.dir))
        return [(d.id, d.env.name, d.task.messages) for d in take(run_task_stream(envs, 5), 40)]

    first = drawn()
    assert first == drawn()
    assert {name for _, name, _ in first} == {"sum", "letters"}
    assert all(task_id.startswith(f"{name}/") for task_id, name, _ in first)
    bad = load_config([], [("orchestrator.envs", '[{name = "a", env = "reasoning_gym:basic_arithmetic"}, '
                                                 '{name = "b", env = "reasoning_gym:letter_counting", '
                                                 'options = {max_word = 3}}]')])
    with pytest.raises(ConfigError, match=r"^orchestrator\.envs\[1\]: env reasoning_gym:letter_counting: unknown "
                                          r"option 'max_word'"):
        run_environments(bad, RunDir(bad.run.dir))


def test_built_scored_and_drawn_off_the_main_thread_with_the_tripwire_armed():
    """The orchestrator builds environments on its own thread: neither building one nor making
    or scoring its tasks may set process-wide torch/transformers state."""
    out = {}

    def build_and_score():
        env = get_environment("reasoning_gym:chain_sum")
        task = take(task_stream(env, 0), 1)[0]
        out["reward"] = score(env, rollout(task, f"<answer>{task.answer['answer']}</answer>"))

    with tripwire.armed(True) as wire:
        thread = threading.Thread(target=build_and_score)
        thread.start()
        thread.join()
    assert wire.verdict() is None and out["reward"] == 1.0


def test_without_the_library_the_error_says_how_to_install_it(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
    with pytest.raises(EnvError, match=r"pip install -e '\.\[reasoning-gym\]'$"):
        get_environment(ARITH)
