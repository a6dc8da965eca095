"""CPU lists, and the plans of `run.core_plan` ("workers", the default, and "auto")."""

import pytest

from fleetrl.config import ConfigError, load_config
from fleetrl.cores import format_cpus, parse_cpus, plan_cores


def test_cpu_lists_read_and_write():
    assert parse_cpus("0") == [0] and parse_cpus("0,2-3") == [0, 2, 3] and parse_cpus("3-3") == [3]
    assert format_cpus([0, 1, 2, 5]) == "0-2,5" and format_cpus([4]) == "4"
    for bad in ("", "a", "1-", "3-1", "0;1"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


@pytest.mark.parametrize("cpus, workers, ranks, expected_workers, expected_ranks", [
    (2, 1, 1, ["0"], ["1"]),  # this machine's `make run`: each its own core
    (16, 1, 1, ["0-7"], ["8-15"]),
    (16, 2, 4, ["0-2", "3-4"], ["5-7", "8-10", "11-13", "14-15"]),
    (4, 3, 1, ["0", "1", "2"], ["3"]),
    (2, 2, 2, ["0", "1"], ["0", "1"]),  # too few: one each, round-robin; no two workers on one core
    (2, 0, 1, [], ["0-1"]),  # attached workers: the trainer takes every core
])
def test_the_plan_gives_each_process_cores_of_its_own_where_there_are_enough(cpus, workers, ranks,
                                                                              expected_workers, expected_ranks):
    plan = plan_cores(list(range(cpus)), workers, ranks)
    assert (plan.workers, plan.ranks) == (expected_workers, expected_ranks)


def test_a_cpu_list_that_is_none_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="trainer.cpu_cores"):
        load_config([], [("trainer.cpu_cores", '["1", "x"]')])
    with pytest.raises(ConfigError, match="inference.vllm.omp_threads_bind"):
        load_config([], [("inference.vllm.omp_threads_bind", '["2-1"]')])
    config = load_config([], [("inference.vllm.omp_threads_bind", '["0", "1-3"]')])
    assert config.inference.vllm.engine_cpus(3) == [1, 2, 3]  # cycled
    assert config.inference.vllm.engine_env(3) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
                                                 "OMP_NUM_THREADS": "3"}
    unbound = load_config([], []).inference.vllm
    assert unbound.engine_cpus(0) == [] and unbound.engine_env(0) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                                      "TORCHDYNAMO_DISABLE": "1"}


def test_the_run_fills_only_what_the_user_left_empty_and_says_so(monkeypatch):
    from fleetrl.app import rl

    monkeypatch.setattr(rl.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    lines = []
    config = load_config([], [("inference.workers", "2"), ("run.core_plan", "auto")])
    rl.apply_core_plan(config, lines.append)
    assert config.inference.vllm.omp_threads_bind == ["0-1", "2"] and config.trainer.cpu_cores == ["3"]
    assert lines == ["fleetrl: core plan: worker 0 on CPU 0-1; worker 1 on CPU 2; trainer rank 0 on CPU 3"]
    mine = load_config([], [("trainer.cpu_cores", '["1"]'), ("inference.urls", '["http://h:1"]'),
                            ("run.core_plan", "auto")])
    rl.apply_core_plan(mine, lines.append)  # attached workers: none to place; the trainer's CPUs are the user's
    assert mine.trainer.cpu_cores == ["1"] and mine.inference.vllm.omp_threads_bind == []
    assert lines[-1] == "fleetrl: core plan: trainer rank 0 on CPU 1"


def test_the_default_plan_spreads_two_launched_workers_and_leaves_one_worker_and_the_ranks_alone(monkeypatch):
    from fleetrl.app import rl

    monkeypatch.setattr(rl.os, "sched_getaffinity", lambda pid: {0, 1})
    lines = []
    two = load_config([], [("inference.workers", "2")])
    assert two.run.core_plan == "workers"
    rl.apply_core_plan(two, lines.append)
    assert two.inference.vllm.omp_threads_bind == ["0", "1"] and two.trainer.cpu_cores == []
    assert lines == ["fleetrl: core plan: worker 0 on CPU 0; worker 1 on CPU 1"]
    one = load_config([], [])
    rl.apply_core_plan(one, lines.append)
    assert one.inference.vllm.omp_threads_bind == [] and one.trainer.cpu_cores == [] and len(lines) == 1
    mine = load_config([], [("inference.workers", "2"), ("inference.vllm.omp_threads_bind", '["1", "1"]')])
    rl.apply_core_plan(mine, lines.append)  # the user's binding stands
    assert mine.inference.vllm.omp_threads_bind == ["1", "1"]
    assert lines[-1] == "fleetrl: core plan: worker 0 on CPU 1; worker 1 on CPU 1"
