"""`env = "dataset"` and the data files it reads (fleetrl.data_files): every file type, chat
prompts, the held-out split, the task stream's exactness across skips, and every bad input's
one line, from the environment and from `fleetrl rl --dry-run`."""

import itertools
import json
import os

import datasets
import pandas as pd
import pytest

from fleetrl.cli import main
from fleetrl.data_files import DataFileError, check_fields, load_table
from fleetrl.envs import EnvError, get_environment, score
from fleetrl.envs.base import Rollout
from fleetrl.envs.mix import RunEnv, run_task_stream

from tests.documented import ROOT

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(20)]


@pytest.fixture(autouse=True)
def fleetrl_cache(tmp_path, monkeypatch):
    """Converted files go to a cache of the test's own, not the user's."""
    monkeypatch.setenv("FLEETRL_CACHE", str(tmp_path / "cache"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def take(stream, n):
    return list(itertools.islice(stream, n))


@pytest.fixture
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", ROWS)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "saved"])
def test_every_file_type_gives_the_same_tasks(tmp_path, kind):
    path = tmp_path / f"train.{kind}"
    if kind == "jsonl":
        write_jsonl(path, ROWS)
    elif kind == "json":  # one JSON array of rows
        path.write_text(json.dumps(ROWS))
    elif kind == "parquet":
        pd.DataFrame(ROWS).to_parquet(path)
    elif kind == "csv":
        pd.DataFrame(ROWS).to_csv(path, index=False)
    else:
        datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    env = get_environment("dataset", path=str(path), reward="exact")
    tasks = take(env.tasks(0), len(ROWS))
    # One pass visits every row once, as a user message, with its answer.
    assert sorted(t.messages[0]["content"] for t in tasks) == sorted(r["prompt"] for r in ROWS)
    for task in tasks:
        row = int(task.id.removeprefix("row").removesuffix("-pass0"))
        assert task.messages == [{"role": "user", "content": ROWS[row]["prompt"]}]
        assert str(task.answer) == ROWS[row]["answer"]
        assert score(env, Rollout(task=task, completion=f" {task.answer}\n", spans=[], step=1)) == 1.0


def test_the_table_is_memory_mapped_from_the_fleetrl_cache(jsonl, tmp_path):
    table = load_table(jsonl)
    assert all(f["filename"].startswith(str(tmp_path / "cache" / "datasets")) for f in table.cache_files)


def test_chat_prompts_and_the_system_prompt(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi"}], "answer": "1"},
            {"messages": [{"role": "system", "content": "Row's own"}, {"role": "user", "content": "Yo", "name": "u"}],
             "answer": "2"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    env = get_environment("dataset", path=str(path), prompt_field="messages", system_prompt="Be brief.")
    tasks = {t.answer: t.messages for t in take(env.tasks(0), 2)}
    assert tasks["1"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    # A row's own system message wins; keys other than role and content are left out.
    assert tasks["2"] == [{"role": "system", "content": "Row's own"}, {"role": "user", "content": "Yo"}]


def test_the_stream_is_exact_for_a_seed_across_passes_and_skips(jsonl):
    env = get_environment("dataset", path=str(jsonl))
    whole = take(env.tasks(3), 70)  # three passes and a half
    assert whole == take(get_environment("dataset", path=str(jsonl)).tasks(3), 70)
    assert whole != take(env.tasks(4), 70)
    for p in range(3):
        ids = [t.id for t in whole[20 * p:20 * (p + 1)]]
        assert sorted(ids) == sorted(f"row{i}-pass{p}" for i in range(20))
    assert [t.id for t in whole[:20]] != [t.id.replace("pass1", "pass0") for t in whole[20:40]]  # each pass its order
    # A resume skips by position (the orchestrator's islice): it draws what the whole stream drew.
    for skip in (0, 7, 20, 33, 61):
        assert list(itertools.islice(env.tasks(3), skip, skip + 9)) == whole[skip:skip + 9]
    run = [RunEnv("arith", env), RunEnv("rev", get_environment("reverse_text"))]
    mixed = [d.id for d in take(run_task_stream(run, 3), 40)]
    assert [d.id for d in itertools.islice(run_task_stream(run, 3), 25, 40)] == mixed[25:]


def test_a_held_out_fraction_is_disjoint_and_the_same_for_every_seed(jsonl):
    env = get_environment("dataset", path=str(jsonl), eval_fraction=0.25)
    held = {t.id for t in env.eval_tasks(0)}
    assert len(held) == 5 and {t.id for t in env.eval_tasks(9)} == held  # each held-out row once, for any seed
    for seed in (0, 1, 2):
        trained = {t.id.partition("-")[0] for t in take(env.tasks(seed), 45)}
        assert len(trained) == 15 and not trained & held
    assert held == {t.id for t in get_environment("dataset", path=str(jsonl), eval_fraction=0.25).eval_tasks(5)}
    assert not hasattr(get_environment("dataset", path=str(jsonl)), "eval_tasks")  # no held-out split unless asked


def test_a_held_out_split_of_a_saved_folder(tmp_path):
    folder = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:15]),
                          "test": datasets.Dataset.from_list(ROWS[15:])}).save_to_disk(str(folder))
    env = get_environment("dataset", path=str(folder), eval_split="test")
    assert {t.messages[0]["content"] for t in take(env.tasks(0), 15)} == {r["prompt"] for r in ROWS[:15]}
    assert {t.messages[0]["content"] for t in env.eval_tasks(0)} == {r["prompt"] for r in ROWS[15:]}
    assert len(load_table(folder, "test")) == 5
    for split in ("train", None):  # the split trained on, named or by default
        with pytest.raises(EnvError, match=rf"^env dataset: eval_split 'train' is the split trained on; hold out "
                                           rf"another split of {folder}$"):
            get_environment("dataset", path=str(folder), split=split, eval_split="train")


def test_answers_keep_the_files_text(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("prompt,answer\nWhat?,0.50\nWho?,007\nHow many?,1e3\nWhich?,NA\n")
    table = load_table(path)
    assert table["answer"] == ["0.50", "007", "1e3", "NA"] and table["prompt"][0] == "What?"
    # JSON keeps JSON's types: an integer beside a fraction loads as 7.0, and is judged as 7.
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a", "answer": 7}, {"prompt": "b", "answer": 2.5}])
    assert load_table(write_jsonl(tmp_path / "ints.jsonl", [{"prompt": "a", "answer": 7}]))["answer"] == [7]
    env = get_environment("dataset", path=str(mixed), reward="exact")
    task = next(t for t in env.tasks(0) if t.id.startswith("row0-"))
    assert task.answer == 7.0 and score(env, Rollout(task=task, completion="7", spans=[], step=1)) == 1.0


def test_a_rewritten_file_is_never_served_from_the_cache_stale(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:3])
    stat = path.stat()
    assert load_table(path)["answer"] == ["0", "2", "4"]
    write_jsonl(path, [{**row, "answer": row["answer"] + "0"} for row in ROWS[:3]])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a rewrite within the clock's tick
    assert load_table(path)["answer"] == ["00", "20", "40"]


def test_check_fields_reports_kinds(jsonl):
    table = load_table(jsonl)
    assert check_fields(table, jsonl, {"prompt": ("text", "messages"), "answer": "any"}) == {
        "prompt": "text", "answer": "any"}


@pytest.mark.parametrize("rows, options, error", [
    (ROWS, {"prompt_field": "question"}, "{path}: no field 'question' (fields: prompt, answer)"),
    (ROWS[:17] + [{"prompt": "What?"}], {}, "{path} row 17: field 'answer' is missing"),
    (ROWS[:3] + [{"prompt": None, "answer": "1"}], {}, "{path} row 3: field 'prompt' is missing"),
    ([{"prompt": 5, "answer": "1"}], {}, "{path} row 0: field 'prompt' is a number, not text (a string) or chat "
                                         "messages (a list of {{role, content}} strings)"),
    (ROWS[:4] + [{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}], {},
     "{path} row 4: field 'prompt' is an array here, a string in the rows before it (a field holds one type in every "
     "row)"),
    ([{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}] * 2
     + [{"prompt": [{"role": "user"}], "answer": "1"}], {},
     "{path} row 2: field 'prompt' has a message without 'content'"),
    ([{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}, {"prompt": [], "answer": "1"}], {},
     "{path} row 1: field 'prompt' holds no messages"),
    (ROWS, {"reward": "nope"}, "unknown reward 'nope' (the menu: exact, contains, regex, math; or "
                               "module.path:function)"),
    (ROWS, {"reward": "no_such_module:judge"}, "reward no_such_module:judge: cannot import module 'no_such_module'"),
    (ROWS, {"reward": "regex"}, "reward regex: missing a required argument: 'pattern'"),
    (ROWS, {"eval_split": "test"}, "{path}: a file has no named splits (split 'test' is for a folder that `datasets` "
                                   "saved)"),
    (ROWS, {"eval_split": "test", "eval_fraction": 0.1}, "eval_split and eval_fraction are both set"),
    (ROWS, {"eval_fraction": 1.0}, "eval_fraction must be in [0, 1), got 1.0"),
])
def test_bad_input_is_one_line_naming_file_row_and_field(tmp_path, rows, options, error):
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(EnvError) as raised:
        get_environment("dataset", path=str(path), **options)
    message = str(raised.value)
    assert message.startswith("env dataset: " + error.format(path=path)) and "\n" not in message


def test_bad_paths_are_one_line(tmp_path):
    (tmp_path / "train.txt").write_text("x")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "folder").mkdir()
    for path, error in [(tmp_path / "nope.jsonl", "no such file or folder"),
                        (tmp_path / "train.txt", "not a .jsonl, .json, .parquet or .csv file, nor a folder that "
                                                 "`datasets` saved"),
                        (tmp_path / "empty.jsonl", "an empty file"),
                        (tmp_path / "folder", "a folder, but not one that `datasets` saved")]:
        with pytest.raises(DataFileError) as raised:
            load_table(path)
        assert str(raised.value).startswith(f"{path}: {error}") and "\n" not in str(raised.value)


def test_a_dry_run_refuses_a_bad_file_in_one_line(tmp_path, capsys):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:5] + [{"prompt": "What?"}])
    config = ["rl", "@", str(ROOT / "configs/default.toml"), "--orchestrator.env", "dataset", "--dry-run"]
    assert main([*config, "--orchestrator.env_options", f'{{path = "{path}"}}']) == 1
    err = capsys.readouterr().err
    assert err == f"fleetrl: error: orchestrator.env: env dataset: {path} row 5: field 'answer' is missing\n"
    write_jsonl(path, ROWS)
    assert main([*config, "--orchestrator.env_options", f'{{path = "{path}"}}']) == 0

