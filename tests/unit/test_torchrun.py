"""The torchrun variables: when `fleetrl rl` is one rank of a group a launcher started, and
how its config follows (trainer.world_size from WORLD_SIZE, refused when it disagrees)."""

import pytest

from fleetrl.cli import main
from fleetrl.errors import FleetrlError
from fleetrl.torchrun import REQUIRED, LaunchedRank, launched_rank

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_no_variable_means_fleetrl_starts_its_own_ranks():
    assert launched_rank({"PATH": "/bin"}) is None


def test_torchruns_variables_give_the_rank_and_its_node():
    assert launched_rank(TORCHRUN) == LaunchedRank(rank=3, world_size=4, local_rank=1, local_world_size=2)
    # A script that sets no LOCAL_WORLD_SIZE: every rank taken to be on one node.
    without = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}
    assert launched_rank(without).local_world_size == 4


@pytest.mark.parametrize("name", REQUIRED)
def test_a_missing_variable_is_named(name):
    with pytest.raises(FleetrlError, match=f"torchrun variables {name} are not set"):
        launched_rank({k: v for k, v in TORCHRUN.items() if k != name})


@pytest.mark.parametrize("changes, message", [
    ({"RANK": "x"}, "RANK = 'x' is not a number"),
    ({"RANK": "4"}, "out of range: RANK 4, WORLD_SIZE 4"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK 2, LOCAL_WORLD_SIZE 2"),
])
def test_numbers_that_cannot_be_a_group_are_refused(changes, message):
    with pytest.raises(FleetrlError, match=message):
        launched_rank({**TORCHRUN, **changes})


def test_under_torchrun_the_trainer_world_is_torchruns(monkeypatch, capsys):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert main(["rl", "--dry-run"]) == 0
    assert "world_size = 4" in capsys.readouterr().out
    assert main(["rl", "--dry-run", "--trainer.world_size", "4"]) == 0  # agreeing is fine

    assert main(["rl", "--dry-run", "--trainer.world_size", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer.world_size = 2, but torchrun started 4 ranks" in err
    assert main(["rl", "--dry-run", "--run.core_plan", "auto"]) == 1
    assert "run.core_plan = 'auto' plans one machine's CPUs" in capsys.readouterr().err


def test_half_set_variables_fail_the_command_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    for name in REQUIRED[1:]:
        monkeypatch.delenv(name, raising=False)
    assert main(["rl", "--dry-run"]) == 1
    assert "torchrun variables WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set" in capsys.readouterr().err


def test_a_rank_that_does_not_see_rank_0s_run_directory_or_model_says_so(tmp_path):
    from fleetrl.app.rl import check_sees_rank0
    from fleetrl.files import sha256_file
    from fleetrl.rundir import RunDir

    run_dir, model_dir = RunDir(tmp_path / "run"), tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    where = "trainer rank 2 on node-b"
    rank0 = {"config_sha256": "0" * 64, "model_dir": str(model_dir)}
    with pytest.raises(FleetrlError, match=r"trainer rank 2 on node-b does not see the run directory .*shared storage"):
        check_sees_rank0(run_dir, rank0, where)  # no config.toml here at all
    run_dir.root.mkdir()
    run_dir.config_path.write_text("[run]\nmax_steps = 3\n")
    with pytest.raises(FleetrlError, match="is missing or another one"):
        check_sees_rank0(run_dir, rank0, where)  # another run's config.toml
    rank0["config_sha256"] = sha256_file(run_dir.config_path)
    assert check_sees_rank0(run_dir, rank0, where) == model_dir
    with pytest.raises(FleetrlError, match=f"does not see the model folder {tmp_path / 'elsewhere'}"):
        check_sees_rank0(run_dir, {**rank0, "model_dir": str(tmp_path / "elsewhere")}, where)
