"""`fleetrl eval MODEL_OR_RUN`: what it scores, where it writes, what it refuses before anything
starts; the whole command against the in-process fake fleet (a real vLLM: the integration suite,
test_kill_points.py)."""

import asyncio
import json
import math
import re
import statistics
from pathlib import Path

import pytest

from fleetrl.app import eval as eval_command
from fleetrl.app.providers import base_weights
from fleetrl.cli import main
from fleetrl.config import Config, ModelConfig, load_config, to_toml
from fleetrl.inference.fleet import Fleet
from fleetrl.records import EvalFigures
from fleetrl.rundir import RunDir, check_eval
from fleetrl.trainer.export import VERSION_FILE

from .fake_fleet import FakeProvider, FakeTransport
from .test_export import trained_run
from .test_orchestrator import Tokenizer
from .test_tokens import no_tokens_in_the_environment  # noqa: F401 (autouse: no token of the shell reaches the command)
from .test_trainer_step import save_tiny_model, save_tiny_tokenizer


@pytest.fixture
def fake_fleet(monkeypatch):
    """`fleetrl eval`'s fleet is the fake one (one launched worker; the fleets it made, for the
    test to look at), and the tokenizer of any model folder the orchestrator tests' fake, which
    an export still copies as the folder has it."""
    from transformers import AutoTokenizer

    fleets = []
    load_tokenizer = AutoTokenizer.from_pretrained

    def build_fleet(config, run_dir, model_dir):
        assert run_dir.root == config.run.dir  # OUT's: its run id labels the workers
        fleets.append(Fleet(FakeProvider("w0"), discovery_interval_s=3600, log=lambda line: None))
        return fleets[-1]

    class FolderTokenizer(Tokenizer):
        def __init__(self, folder) -> None:
            self.folder = folder

        def save_pretrained(self, to) -> None:
            load_tokenizer(self.folder).save_pretrained(to)

    monkeypatch.setattr(eval_command, "build_fleet", build_fleet)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", FolderTokenizer)
    return fleets


def model_folder(path: Path) -> Path:
    """A folder that passes for a Hugging Face model (the fake fleet loads nothing from it)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def finished_run(path: Path, version: int, **settings) -> Path:
    """A run directory with its config.toml (`settings`: dotted fields) and a final model at `version`."""
    path.mkdir()
    (path / "config.toml").write_text(to_toml(load_config([], list(settings.items()))))
    model_folder(path / "final_model").joinpath(VERSION_FILE).write_text(json.dumps({"version": version}))
    return path


def printed_table(out: str) -> dict[str, dict[str, str]]:
    """The table on stdout, by environment and column."""
    header, *rows = [line.split() for line in out.strip().splitlines()]
    return {row[0]: dict(zip(header[1:], row[1:])) for row in rows}


def records(out_dir: Path, version: int) -> list[dict]:
    return [json.loads(line) for line in RunDir(out_dir).eval_records_path(version).read_text().splitlines()]


def test_a_runs_final_model_is_scored_at_the_runs_final_version_with_the_runs_config(tmp_path, fake_fleet, capsys):
    """The run's config.toml is the base (its environment, its eval.prompts), the command line's
    flags go on top; every token scored carries the final version; the table is the records'."""
    run = finished_run(tmp_path / "run", 5, **{"orchestrator.env": "arithmetic", "eval.prompts": "7",
                                               "orchestrator.max_tokens": "4"})
    assert main(["eval", str(run), "--eval.prompts", "3"]) == 0
    out, err = capsys.readouterr()
    out_dir = tmp_path / "run-eval-v5"  # beside the run: never in it
    assert f"fleetrl eval: {run / 'final_model'} at v5: 3 prompt(s) of arithmetic" in err
    assert f"records in {out_dir}" in err and "fleetrl: evaluated v5" in err
    scored = records(out_dir, 5)
    assert len(scored) == 3 and all(r["spans"] == [[5, 0]] for r in scored)
    check_eval(RunDir(out_dir), 5)
    (line,) = RunDir(out_dir).read_evals()
    figures = line.envs["arithmetic"]
    assert line.version == 5 and figures.prompts == 3 and figures.samples == 3
    table = printed_table(out)
    assert list(table) == ["arithmetic"]
    assert table["arithmetic"] == {"prompts": "3", "completions": "3", "reward_mean": f"{figures.reward_mean:.3f}",
                                   "reward_se": f"{figures.reward_se:.3f}", "pass@1": f"{figures.pass_at[1]:.3f}",
                                   "failed": str(figures.failed)}
    assert figures.reward_mean == pytest.approx(sum(r["reward"] for r in scored) / 3)
    assert figures.reward_se == pytest.approx(statistics.stdev(r["reward"] for r in scored) / math.sqrt(3))
    # The run as it was, but for the lock it was held by while its model was scored.
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.toml", "final_model"]
    (fleet,) = fake_fleet
    assert fleet.version == 5 and fleet.provider.engines["w0"].version == 5


def test_a_model_folder_is_scored_at_v0_and_pass_at_k_is_shown_for_k_above_1(tmp_path, fake_fleet, capsys):
    model = model_folder(tmp_path / "model")
    out_dir = tmp_path / "scores"
    assert main(["eval", str(model), "--out", str(out_dir), "--eval.prompts", "2", "--eval.greedy", "false",
                 "--eval.samples_per_prompt", "3", "--orchestrator.max_tokens", "4"]) == 0
    table = printed_table(capsys.readouterr().out)
    assert list(table) == ["reverse_text"] and set(table["reverse_text"]) == {
        "prompts", "completions", "reward_mean", "reward_se", "pass@1", "pass@3", "failed"}
    assert table["reverse_text"]["completions"] == "6"
    assert all(r["spans"] == [[0, 0]] for r in records(out_dir, 0))
    assert (out_dir / "eval.jsonl").exists()


def test_without_a_model_or_run_the_configs_own_model_is_scored_into_out(tmp_path, fake_fleet, capsys):
    """The base a run would start from (model.path here; unset, the embedded default), at v0."""
    model = model_folder(tmp_path / "base")
    out_dir = tmp_path / "base-scores"
    assert main(["eval", "--model.path", str(model), "--out", str(out_dir), "--eval.prompts", "2",
                 "--orchestrator.max_tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert f"fleetrl eval: {model} at v0: 2 prompt(s) of reverse_text" in err
    assert list(printed_table(out)) == ["reverse_text"] and len(records(out_dir, 0)) == 2


def test_a_checkpoint_is_exported_into_a_temporary_folder_and_scored_at_its_step(tmp_path, fake_fleet, capsys):
    """No final model (or --step N): the checkpoint, exported with `fleetrl export`'s code into
    OUT, which keeps nothing of it once the command ends."""
    base = tmp_path / "base"
    save_tiny_model(base)
    save_tiny_tokenizer(base)
    run = tmp_path / "run"
    trained_run(base, run, steps=(1, 2))
    assert main(["eval", str(run), "--eval.prompts", "2", "--orchestrator.max_tokens", "4"]) == 0
    assert "the checkpoint of step 2 of" in capsys.readouterr().err
    assert all(r["spans"] == [[2, 0]] for r in records(tmp_path / "run-eval-v2", 2))
    assert main(["eval", str(run), "--step", "1", "--eval.prompts", "2", "--orchestrator.max_tokens", "4"]) == 0
    assert all(r["spans"] == [[1, 0]] for r in records(tmp_path / "run-eval-v1", 1))
    assert sorted(p.name for p in (tmp_path / "run-eval-v1").iterdir()) == [".lock", "eval", "eval.jsonl"]


def test_attached_workers_are_held_to_the_models_weights_at_its_version(tmp_path):
    """Attached workers are held, as `fleetrl rl` holds them, to the weights of the model scored:
    loaded from its folder, at the version given; launched ones need none (they load the folder)."""
    model = tmp_path / "model"
    save_tiny_model(model)
    attached = FakeProvider("w0", launches_workers=False)
    source = asyncio.run(base_weights(attached, model, FakeTransport(attached), version=7)())
    assert source.version == 7 and source.probe.token_ids and source.checksum and list(source.named_tensors())
    assert base_weights(FakeProvider("w0"), model, FakeTransport(attached), version=7) is None


@pytest.mark.parametrize("args, message", [
    (["eval"], "fleetrl eval without MODEL_OR_RUN scores the config's own model (model.path, else the embedded "
               "default): name a new folder for its records with --out DIR"),
    (["eval", "--model.path", "{tmp}/model", "--out", "{tmp}/empty"], "--out {tmp}/empty exists"),
    (["eval", "{tmp}/nowhere"], "MODEL_OR_RUN {tmp}/nowhere does not exist"),
    (["eval", "{tmp}/empty"], "MODEL_OR_RUN {tmp}/empty is neither a Hugging Face model folder (no config.json) nor a "
                              "run directory (no config.toml)"),
    (["eval", "{tmp}/model", "--step", "3"], "--step 3: {tmp}/model is a model folder, not a run directory with "
                                             "checkpoints"),
    (["eval", "{tmp}/untrained"], "{tmp}/untrained: no complete checkpoint to export (its config has "
                                  "trainer.checkpoint_interval = 10)"),
    (["eval", "{tmp}/untrained", "--step", "3"], "no checkpoint of step 3 in {tmp}/untrained/checkpoints (steps "
                                                 "checkpointed: none)"),
    (["eval", "{tmp}/no-version"], "{tmp}/no-version/final_model has no fleetrl_version.json (a final model of an "
                                   "older fleetrl) to say which version it is: score a checkpoint with --step N"),
    (["eval", "{tmp}/model", "--out", "{tmp}/no-version/eval"], "--out {tmp}/no-version/eval is inside the run "
                                                                "directory {tmp}/no-version"),
    (["eval", "{tmp}/model", "--out", "{tmp}/empty"], "--out {tmp}/empty exists: fleetrl eval writes a new folder "
                                                      "(remove it, or name another)"),
    (["eval", "{tmp}/model", "--eval.prompts", "0"], "eval.prompts"),
    (["eval", "{tmp}/model", "--orchestrator.env", "nope"], "orchestrator.env: unknown environment 'nope'"),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_bad_argument_is_one_line_naming_it_before_anything_starts(tmp_path, fake_fleet, capsys, args,
                                                                     message, dry_run):
    model_folder(tmp_path / "model")
    (tmp_path / "empty").mkdir()
    (tmp_path / "untrained").mkdir()
    (tmp_path / "untrained" / "config.toml").write_text(to_toml(Config()))
    finished_run(tmp_path / "no-version", 3).joinpath("final_model", VERSION_FILE).unlink()
    before = sorted(tmp_path.rglob("*"))
    assert main([arg.format(tmp=tmp_path) for arg in args] + (["--dry-run"] if dry_run else [])) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fleetrl: error: ") and message.format(tmp=tmp_path) in err and "\n" not in err, err
    assert sorted(tmp_path.rglob("*")) == before and not fake_fleet  # nothing written, nothing started


def test_the_dry_run_prints_the_runs_config_under_the_command_lines(tmp_path, fake_fleet, capsys):
    run = finished_run(tmp_path / "run", 2, **{"orchestrator.env": "arithmetic", "eval.prompts": "7",
                                               "eval.pass_reward": "0.5"})
    assert main(["eval", str(run), "--eval.prompts", "3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert 'env = "arithmetic"' in out and re.search(r"^prompts = 3$", out, re.M) and "pass_reward = 0.5" in out
    assert not (tmp_path / "run-eval-v2").exists() and not fake_fleet


def test_a_run_whose_config_an_older_fleetrl_wrote_is_read_with_its_loss_options_in_trainer_loss(
        tmp_path, fake_fleet, capsys):
    """Before [trainer.loss] (issue 38) the loss options were [trainer] keys of config.toml."""
    run = finished_run(tmp_path / "run", 2)
    saved = (run / "config.toml").read_text().replace("kl_coef = 0.0\n", "")
    (run / "config.toml").write_text(saved.replace("[trainer]\n", "[trainer]\nkl_coef = 0.01\n"))
    assert main(["eval", str(run), "--dry-run"]) == 0
    assert "kl_coef = 0.01" in capsys.readouterr().out.split("[trainer.loss]")[1].split("[", 1)[0]


@pytest.mark.parametrize("target, version, out", [
    ("runs/default", 5, "runs/default-eval-v5"),
    ("runs/default/final_model", 0, "runs/default-final_model-eval"),  # beside the run, not in it
    ("models/smol", 0, "models/smol-eval"),
])
def test_the_default_out_is_beside_what_is_scored_and_never_inside_a_run(tmp_path, target, version, out):
    run = tmp_path / "runs" / "default"
    run.mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(Config()))
    model_folder(run / "final_model")
    model_folder(tmp_path / "models" / "smol")
    assert eval_command.default_out(tmp_path / target, version) == tmp_path / out


def test_the_table_has_a_row_per_environment_and_a_dash_for_what_nothing_scored():
    figures = {"reverse": {"prompts": 2, "samples": 8, "failed": 0, "reward_mean": 0.4375, "reward_se": 0.0625,
                           "pass@1": 0.25, "pass@4": 0.5},
               "arithmetic": {"prompts": 2, "samples": 8, "failed": 8, "reward_mean": None, "reward_se": None,
                              "pass@1": None, "pass@4": None}}
    figures = {name: EvalFigures.read(f, name) for name, f in figures.items()}
    assert eval_command.table(figures, k=4).splitlines() == [
        "environment  prompts  completions  reward_mean  reward_se  pass@1  pass@4  failed",
        "reverse      2        8            0.438        0.062      0.250   0.500   0",
        "arithmetic   2        8            -            -          -       -       8",
    ]
