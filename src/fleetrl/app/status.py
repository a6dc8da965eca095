"""`fleetrl status`: each worker of a fleet — role, state, policy version, weights, load, last publish.

It attaches through the provider protocol (discovery, then each worker's admin client), so it
reads native vLLM servers and Dynamo workers alike, and it never launches anything. Given a
run directory, it attaches to the fleet that run recorded there while it runs (fleet.json,
tokens.json); once the run has ended, it reports what the run left (final.json, events.jsonl).
Otherwise it attaches to the fleet the config names.

Every column comes from the workers themselves, so a fleet that no fleetrl coordinates reads
the same: the state from health, pause and weight state (a worker behind the newest version
any worker holds is stale), the checksum and the last publish time from each rank's receiver,
the requests in flight from the engine's own gauges.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from fleetrl.app.providers import PROVIDERS, attached_to_run, build_provider, resolve_tokens
from fleetrl.config import Config, ConfigError
from fleetrl.errors import FleetrlError
from fleetrl.inference.provider import WorkerControl
from fleetrl.inference.types import WorkerInfo
from fleetrl.records import FenceEvent
from fleetrl.rundir import RunDir, eval_summary
from fleetrl.versions import version_name

CHECKSUM_SHOWN = 12  # hex digits of a checksum: enough to tell versions apart at a glance
COLUMNS = ("WORKER", "ROLE", "STATE", "VERSION", "CHECKSUM", "IN-FLIGHT", "LAST PUBLISH")


@dataclass
class WorkerRow:
    id: str
    role: str
    state: str  # ready | paused | updating | stale | dead | error | stopped (a finished run's)
    version: int | None = None
    checksum: str = "-"  # a prefix; "base": it received none since launch; "mixed": its ranks differ
    in_flight: int | None = None
    published_at: float | None = None  # when its ranks last received weights (Unix time)
    error: str | None = None  # why a call to it failed (state "error")

    def cells(self, now: float) -> tuple[str, ...]:
        return (self.id, self.role, self.state, version_name(self.version) if self.version is not None else "-",
                self.checksum, "-" if self.state == "stopped" else "?" if self.in_flight is None else str(self.in_flight),
                since(self.published_at, now))


def since(stamp: float | None, now: float) -> str:
    if stamp is None:
        return "never"
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stamp))} ({max(0.0, now - stamp):.0f} s ago)"


def table(rows: list[WorkerRow], now: float) -> str:
    """The rows in aligned columns, then one line per worker that failed a call, saying why."""
    text = aligned([COLUMNS] + [row.cells(now) for row in rows])
    return "\n".join(text + [f"{row.id}: {row.error}" for row in rows if row.error])


def aligned(lines: list[tuple[str, ...]]) -> list[str]:
    """Lines of cells (a header first) as text in columns: each as wide as its widest cell."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]


async def run_status(config: Config, run_dir: Path | None = None) -> int:
    """Prints the worker table; 1 when any worker is down or did not answer."""
    if run_dir is not None:
        run = RunDir(run_dir)
        if run.recorded_kind() == "sft":
            raise FleetrlError(f"{run.root} holds a `fleetrl {run.recorded_kind()}` run, which has no inference "
                               f"fleet: its steps are in {run.metrics_path}")
        if not run.fleet_path.exists() and run.final_path.exists():
            print(finished_run(run))
            return 0
        recorded = run.recorded_fleet()  # where its fleet runs, and its tokens
        config = attached_to_run(config, recorded)
        print(f"run {run.root}: {running(run)}")
    missing = PROVIDERS[config.inference.provider].missing_to_attach(config.inference)
    if missing:
        raise ConfigError(f"fleetrl status needs {missing}")
    tokens = resolve_tokens(config.inference, draw_missing=False)  # only those given: a fresh one would open nothing
    provider = build_provider(config, RunDir(config.run.dir), model_dir=None, tokens=tokens, runs=False)
    try:
        workers = await provider.discover()
        rows = await asyncio.gather(*(worker_row(w, provider.admin(w)) for w in workers))
    finally:
        await provider.close()
    mark_stale(rows)
    print(table(rows, time.time()) if rows else "no worker discovered")
    return 0 if rows and all(r.state in ("ready", "paused", "updating", "stale") for r in rows) else 1


async def worker_row(worker: WorkerInfo, admin: WorkerControl) -> WorkerRow:
    row = WorkerRow(worker.id, worker.role.value, "dead")
    try:
        if not await admin.health():
            return row
        row.version, paused, ranks = await admin.version(), await admin.is_paused(), await admin.weight_state()
        row.in_flight = await admin.in_flight()
    except FleetrlError as e:
        row.state, row.error = "error", str(e)
        return row
    checksums = {rank.checksum for rank in ranks}
    row.checksum = "mixed" if len(checksums) > 1 else ("base" if checksums == {None} else checksums.pop()[:CHECKSUM_SHOWN])
    row.published_at = max((rank.received_at for rank in ranks if rank.received_at is not None), default=None)
    if any(rank.updating for rank in ranks):
        row.state = "updating"
    elif paused:
        row.state = "paused"
    elif row.version is None or row.checksum == "mixed":
        row.state = "stale"  # it holds no policy version (an update that failed) or its ranks disagree
    else:
        row.state = "ready"
    return row


def mark_stale(rows: list[WorkerRow]) -> None:
    """A serving worker behind the newest version any worker holds is stale."""
    newest = max((r.version for r in rows if r.version is not None), default=None)
    for row in rows:
        if row.state == "ready" and row.version != newest:
            row.state = "stale"


def steps_done(run: RunDir) -> str:
    steps = run.read_metrics()
    max_steps = _max_steps(run)
    done = f"step {steps[-1].step} of {max_steps} done" if steps else f"no step done yet (of {max_steps})"
    return done + last_evaluation(run)


def last_evaluation(run: RunDir) -> str:
    """The last evaluation's figures (eval.every_steps), per environment; empty without one."""
    evals = run.read_evals()
    if not evals:
        return ""
    return f"; evaluated at v{evals[-1].version}: {eval_summary(evals[-1].envs)}"


def running(run: RunDir) -> str:
    """How far a running run is, and the pid that holds its directory."""
    pid = run.lock_path.read_text().strip() if run.lock_path.exists() else ""
    return steps_done(run) + (f", fleetrl pid {pid}" if pid else "")


def finished_run(run: RunDir) -> str:
    """What a run that has ended left: its last step, and each worker's version and checksum at
    the end, stamped with the end of the last publish fence."""
    final = run.read_final()
    fences = [e for e in run.read_events() if isinstance(e, FenceEvent) and e.phase == "end"
              and e.version == final.version]
    published = fences[-1].t if fences else None
    rows = [WorkerRow(worker, w.role, "stopped", w.version, (w.checksum or "base")[:CHECKSUM_SHOWN], None, published)
            for worker, w in sorted(final.workers.items())]
    head = (f"run {run.root}: finished at v{final.version} ({steps_done(run)}); its fleet has "
            f"stopped: the workers as the run left them")
    return head + "\n" + table(rows, time.time())


def _max_steps(run: RunDir) -> int | str:
    return run.read_config().run.max_steps if run.config_path.exists() else "?"
