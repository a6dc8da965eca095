"""`fleetrl rl`'s live view, on a terminal: step progress with an ETA, the rollouts done for the
step being sampled, what the trainer is doing, and a worker table (state, version, requests in
flight), redrawn a few times a second below the run's log lines.

The view only reads: the control loop copies the fleet's and the orchestrator's state into it
(`watch`, on the loop: the one thread that changes the fleet), the training loop's hooks say
the trainer's phase. Startup bars (the model conversion, the workers' start-up) are drawn in
it too (fleetrl.progress). When stdout is no terminal, or with `run.live_view = "off"`, there
is no view: the run prints its plain lines only.
"""

from __future__ import annotations

import asyncio

from fleetrl import progress
from fleetrl.inference.fleet import Fleet
from fleetrl.orchestrator.rollouts import Orchestrator
from fleetrl.versions import version_name

REFRESH_S = 0.25


class LiveView:
    def __init__(self, max_steps: int, done_steps: int, samples_per_step: int) -> None:
        from rich.live import Live
        from rich.progress import Progress

        self.bars = Progress(*progress.columns())
        self.steps = self.bars.add_task("steps", total=max_steps, completed=done_steps, detail="")
        self.rollouts = self.bars.add_task("rollouts", total=samples_per_step, detail="", visible=False)
        self.phase = "starting"
        self.workers: list[tuple[str, str, str, str, int]] = []  # id, role, state, version, in flight
        # The log lines the run prints go above the view (stdout and stderr redirected to it).
        self.live = Live(get_renderable=self.render, refresh_per_second=1 / REFRESH_S, transient=False,
                         redirect_stdout=True, redirect_stderr=True)

    def start(self) -> None:
        self.live.start()
        progress.share_with(self.bars)

    def stop(self) -> None:
        progress.share_with(None)
        self.live.stop()

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def step_done(self, step: int, detail: str) -> None:
        self.bars.update(self.steps, completed=step, detail=detail)

    async def watch(self, fleet: Fleet, orchestrator: Orchestrator) -> None:
        """On the control loop, until cancelled: copy what the view shows of the fleet and the
        orchestrator."""
        while True:
            self.workers = [(w.id, w.role.value, w.state.value, version_name(w.version) if w.version is not None else "-",
                             fleet.in_flight(w.id)) for w in fleet.workers.values()]
            if orchestrator.progress is not None:
                step, done = orchestrator.progress
                self.bars.update(self.rollouts, description=f"rollouts of step {step}", completed=done, visible=True)
            await asyncio.sleep(REFRESH_S)

    def render(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False, header_style="bold")
        for column in ("worker", "role", "state", "version", "in flight"):
            table.add_column(column)
        for worker, role, state, version, in_flight in self.workers:
            style = {"ready": "green", "stale": "red", "dead": "red"}.get(state, "yellow")
            table.add_row(worker, role, Text(state, style=style), version, str(in_flight))
        return Group(self.bars, Text(f"trainer: {self.phase}", style="cyan"), table)
