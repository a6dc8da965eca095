"""Two coordinators on one worker (issue 27, item 3): version labels carry the run, and a
worker is held by one run at a time (engine/worker_claim.py, through the admin middleware)."""

import json
import os
import socket

import pytest

from fleetrl.config import load_config
from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV
from fleetrl.engine.admin_auth import AdminTokenMiddleware
from fleetrl.engine.worker_claim import WorkerClaim
from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.http import RunClaim
from fleetrl.inference.provider import WorkerHeldByAnotherRun
from fleetrl.inference.types import UnversionedTokens, WorkerState, engine_spans
from fleetrl.inference.vllm.admin import VllmAdminRoutes, VllmWorkerControl
from fleetrl.rundir import RunDir
from fleetrl.versions import VersionSpan, is_run_id

from .asgi_server import serving
from .fake_fleet import FakeProvider

ADMIN = "admin-secret"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_claim_is_one_runs_until_it_lets_go_or_its_lease_lapses():
    clock = Clock()
    claim = WorkerClaim(clock)
    assert claim.begin("A", 30) is None
    claim.end("A", 30)
    assert claim.begin("B", 30) == "A"  # refused, naming the holder
    clock.now += 29
    assert claim.begin("B", 30) == "A"
    clock.now += 2  # 31 s after A's last call
    assert claim.begin("B", 30) is None and claim.holder() == "B"
    claim.release("A")  # not A's to release
    assert claim.holder() == "B"
    claim.release("B")
    assert claim.holder() is None and claim.begin("A", 30) is None


def test_a_call_in_progress_holds_the_claim_however_long_it_takes():
    clock = Clock()
    claim = WorkerClaim(clock)
    assert claim.begin("A", 1) is None  # a long transfer, say
    clock.now += 600
    assert claim.begin("B", 1) == "A"
    claim.end("A", 1)
    clock.now += 0.5
    assert claim.begin("B", 1) == "A"  # the lease runs from the call's end
    clock.now += 1
    assert claim.begin("B", 1) is None


def versioned(label: str):
    """A worker's app that reports its weights as `label` to every call."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps({"weight_version": label}).encode()})
    return app


@pytest.fixture
def worker(monkeypatch):
    """One worker behind fleetrl's middleware, at v3 of run A."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, "data-secret")
    with serving(AdminTokenMiddleware(versioned("v3@runA"))) as url:
        yield url


def admin_of(url: str, run: str | None, lease_s: float = 30) -> VllmWorkerControl:
    return VllmWorkerControl(VllmAdminRoutes(url, url, ADMIN, timeout_s=5, retries=0,
                                             claim=RunClaim(run, lease_s) if run is not None else None))


async def test_a_worker_another_run_holds_refuses_it_naming_both(worker):
    """Two runs attached to one URL: the second is refused at its first call with one line that
    names the worker and the run holding it, until the first lets go (its fleet stopped)."""
    a, b, looker = admin_of(worker, "runA"), admin_of(worker, "runB"), admin_of(worker, None)
    try:
        assert await a.health() and await a.version() == 3
        for call in (b.health, b.version, b.is_paused):
            with pytest.raises(WorkerHeldByAnotherRun, match=rf"^worker {worker}: .* held by another fleetrl run, "
                                                              r"runA \(its claim lapses 30 s after"):
                await call()
        assert await looker.version() == 3  # fleetrl status: looks, holds nothing, refused nothing
        await a.close()  # lets the worker go
        assert await b.health()
        assert await b.version() is None  # run A's v3 is no version of run B's
        with pytest.raises(WorkerHeldByAnotherRun, match="held by another fleetrl run, runB"):
            await admin_of(worker, "runA").health()
    finally:
        for client in (b, looker):
            await client.close()


async def test_a_killed_runs_claim_lapses_after_its_lease(monkeypatch):
    """The lease runs on the worker's clock, moved here by hand: on a busy machine a real
    0.3 s lease could lapse before run B's first call."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, "data-secret")
    clock, app = Clock(), AdminTokenMiddleware(versioned("v3@runA"))
    app.claim = WorkerClaim(clock)
    with serving(app) as worker:
        a, b = admin_of(worker, "runA"), admin_of(worker, "runB")  # leases of 30 s
        try:
            assert await a.health()  # then run A is killed: it never lets go
            with pytest.raises(WorkerHeldByAnotherRun):
                await b.health()
            clock.now += 29.9
            with pytest.raises(WorkerHeldByAnotherRun):
                await b.health()
            clock.now += 0.2
            assert await b.health()
        finally:
            await b.close()


def test_every_token_must_carry_a_version_of_this_run():
    spans = engine_spans("w", "r", [{"version": "v2@runA", "start": 0, "end": 4},
                                    {"version": "v3@runA", "start": 4, "end": 6}], "runA", 6)
    assert spans == [VersionSpan(2, 0), VersionSpan(3, 4)]
    with pytest.raises(UnversionedTokens, match=r"^worker w: request r produced tokens under weight version "
                                                r"'v3@runB', run runB's, not this run's \(runA\)"):
        engine_spans("w", "r", [{"version": "v2@runA", "start": 0, "end": 4},
                                {"version": "v3@runB", "start": 4, "end": 6}], "runA", 6)
    with pytest.raises(UnversionedTokens, match="'v3', not a fleetrl policy version"):
        engine_spans("w", "r", [{"version": "v3", "start": 0, "end": 1}], "runA", 1)


def new_run(root) -> str:
    """The run id of a new run started in `root`: what its fleet labels and claims workers with."""
    run = RunDir(root)
    run.start(load_config([], []), resume=0)
    run.close()
    return run.run_id()


def test_two_new_runs_never_share_an_id_whatever_their_host_and_path_say(tmp_path, monkeypatch):
    """The id was sha256(hostname + resolved run dir): two containers with one hostname and the
    default runs/default had one, and both held the claim and took each other's labels (issue 36,
    item 2). Now it is drawn at random at the first start and kept in the run directory."""
    monkeypatch.setattr(socket, "gethostname", lambda: "container")
    a = new_run(tmp_path / "a" / "runs" / "default")
    b = new_run(tmp_path / "b" / "runs" / "default")
    # runs/default at one path again, once the first run is gone from it (the other container's).
    os.rename(tmp_path / "a" / "runs" / "default", tmp_path / "a" / "runs" / "moved")
    c = new_run(tmp_path / "a" / "runs" / "default")
    assert len({a, b, c}) == 3 and all(is_run_id(run) for run in (a, b, c))
    assert RunDir(tmp_path / "a" / "runs" / "moved").run_id() == a  # each keeps its own


async def test_a_second_run_on_a_worker_claimed_under_another_id_is_refused(worker, tmp_path, monkeypatch):
    """The two containers' runs of the test above, attached to one worker: the second is refused,
    naming the first; a resume of the first takes the worker back at once."""
    monkeypatch.setattr(socket, "gethostname", lambda: "container")
    first = new_run(tmp_path / "runs" / "default")
    os.rename(tmp_path / "runs" / "default", tmp_path / "first")
    second = new_run(tmp_path / "runs" / "default")
    a, b = admin_of(worker, first), admin_of(worker, second)
    resumed = admin_of(worker, RunDir(tmp_path / "first").run_id())
    try:
        assert await a.health()
        with pytest.raises(WorkerHeldByAnotherRun, match=f"held by another fleetrl run, {first} "):
            await b.health()
        assert await resumed.health()
    finally:
        for client in (a, b, resumed):
            await client.close()


async def test_a_fleet_whose_only_worker_another_run_holds_does_not_start_and_says_why(monkeypatch):
    provider = FakeProvider("a")
    logged = []

    async def held():
        raise WorkerHeldByAnotherRun("a", "GET /health", "runA", 12)

    fleet = Fleet(provider, discovery_interval_s=3600, log=logged.append)
    (worker,) = await provider.discover()
    monkeypatch.setattr(provider.admin(worker), "health", held)
    with pytest.raises(FleetrlError, match=r"no inference worker became ready: .*worker a: GET /health failed: "
                                           r"held by another fleetrl run, runA"):
        await fleet.start()
    assert fleet.workers["a"].state == WorkerState.STALE  # not dead: not this run's to restart
    assert sum("held by another fleetrl run, runA" in line for line in logged) == 1
    await fleet.close()
