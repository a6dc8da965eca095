"""`fleetrl status`: each worker's row from what it reports, and what a finished run left."""

import json

import pytest

from fleetrl.app.status import WorkerRow, mark_stale, worker_row
from fleetrl.cli import main
from fleetrl.config import Config, to_toml
from fleetrl.errors import FleetrlError
from fleetrl.contract import RankWeights
from fleetrl.inference.types import WorkerInfo, WorkerRole
from fleetrl.records import EvalFigures
from fleetrl.rundir import eval_summary

from .step_lines import step_dict


class Admin:
    def __init__(self, healthy=True, version=3, paused=False, ranks=(RankWeights(checksum="ab" * 32, received_at=100.0),),
                 in_flight=2, error=None):
        self.healthy, self._version, self.paused, self.ranks = healthy, version, paused, list(ranks)
        self._in_flight, self.error = in_flight, error

    async def health(self):
        return self.healthy

    async def version(self):
        if self.error:
            raise FleetrlError(self.error)
        return self._version

    async def is_paused(self):
        return self.paused

    async def weight_state(self):
        return self.ranks

    async def in_flight(self):
        return self._in_flight


WORKER = WorkerInfo("w0", "http://h:1", "http://h:1", role=WorkerRole.DECODE)


@pytest.mark.parametrize("admin, state, checksum", [
    (Admin(), "ready", "ab" * 6),
    (Admin(paused=True), "paused", "ab" * 6),
    (Admin(ranks=[RankWeights(checksum=None, updating=True)]), "updating", "base"),
    (Admin(version=None), "stale", "ab" * 6),  # labelled incomplete-vN by a failed update
    (Admin(ranks=[RankWeights(checksum="a" * 64, received_at=1.0), RankWeights(checksum="b" * 64, received_at=2.0)]),
     "stale", "mixed"),
    (Admin(healthy=False), "dead", "-"),
])
async def test_a_workers_row_is_what_it_reports(admin, state, checksum):
    row = await worker_row(WORKER, admin)
    assert (row.role, row.state, row.checksum) == ("decode", state, checksum)
    if state != "dead":
        stamps = [r.received_at for r in admin.ranks if r.received_at is not None]
        assert row.in_flight == 2 and row.published_at == (max(stamps) if stamps else None)


async def test_a_worker_that_fails_a_call_is_an_error_row_and_one_behind_is_stale():
    row = await worker_row(WORKER, Admin(error="worker w0: GET /weight_info failed: HTTP 500"))
    assert (row.state, row.error) == ("error", "worker w0: GET /weight_info failed: HTTP 500")
    rows = [WorkerRow("a", "aggregated", "ready", 4), WorkerRow("b", "aggregated", "ready", 3)]
    mark_stale(rows)
    assert [r.state for r in rows] == ["ready", "stale"]


def finished_run(tmp_path, workers: dict):
    """A run directory as a run of 2 steps leaves it, its workers as `workers` says."""
    run = tmp_path / "run"
    run.mkdir()
    config = Config()
    config.run.max_steps = 2
    (run / "config.toml").write_text(to_toml(config))
    (run / "metrics.jsonl").write_text("".join(json.dumps(step_dict(s)) + "\n" for s in (1, 2)))
    # A run's final.json from before the agreement probe was kept (December 2026): it still reads.
    (run / "final.json").write_text(json.dumps({"version": 2, "tokens": [1, 2], "text": "a b", "spans": [[2, 0]],
                                                "workers": workers}))
    return run


def test_status_of_a_finished_run_shows_how_it_left_its_workers(tmp_path, capsys):
    run = finished_run(tmp_path, {"w0": {"role": "aggregated", "version": 2, "checksum": "c" * 64}})
    (run / "events.jsonl").write_text(json.dumps({"t": 1e9, "event": "fence", "phase": "end", "version": 2,
                                                  "ready": ["w0"]}) + "\n")
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"run {run}: finished at v2 (step 2 of 2 done); its fleet has stopped: the workers as the run left them"
    assert out[1].split() == ["WORKER", "ROLE", "STATE", "VERSION", "CHECKSUM", "IN-FLIGHT", "LAST", "PUBLISH"]
    cells = out[2].split()
    assert cells[:6] == ["w0", "aggregated", "stopped", "v2", "c" * 12, "-"] and "ago)" in out[2]


def test_status_of_a_run_says_its_last_evaluation(tmp_path, capsys):
    run = finished_run(tmp_path, {})
    (run / "eval.jsonl").write_text("".join(json.dumps({"version": v, "started": 0.0, "seconds": 1.0, "envs": {"arith": {
        "prompts": 4, "samples": 4, "failed": 0, "reward_mean": 0.1 * v, "reward_se": 0.015 * v, "pass@1": 0.05 * v}}})
        + "\n" for v in (0, 2)))
    assert main(["status", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"run {run}: finished at v2 (step 2 of 2 done; evaluated at v2: arith reward 0.200 ± 0.030 pass@1 0.100); "
        "its fleet has stopped: the workers as the run left them")
    # A line without a standard error (one prompt; a run older than it) shows the mean alone.
    older = EvalFigures.read({"prompts": 1, "samples": 1, "failed": 0, "reward_mean": 0.2, "pass@1": 0.1}, "a line")
    assert eval_summary({"arith": older}) == "arith reward 0.200 pass@1 0.100"
