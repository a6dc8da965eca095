"""The environments of one run and the one task stream they make together: one environment's own
stream, or for several (`[[orchestrator.envs]]`) task i from the environment a seeded draw by
weight picks for position i, known to the run by its id prefixed with the environment's name
(`arith/17`). The stream is deterministic in the run's seed, so a resume seeks by position
(`run_task_stream(..., start)`) and draws what an uninterrupted run would. docs/environments.md,
"Several environments in one run"."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

from fleetrl.envs.base import Environment, Task, task_stream


@dataclass(frozen=True)
class RunEnv:
    """One environment of the run: the name its figures and records are reported under."""

    name: str
    env: Environment
    weight: float = 1.0


@dataclass(frozen=True)
class Drawn:
    """A task of the run's stream, with the environment it came from and the run's id of it."""

    env: RunEnv
    task: Task
    id: str


def entry_seed(seed: int, name: str) -> int:
    """The seed of the run's environment `name`, when it has several."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "big")


def run_task_stream(envs: list[RunEnv], seed: int, start: int = 0) -> Iterator[Drawn]:
    """The run's tasks, in order (see the module's docstring), from position `start` on: each
    environment's stream seeks to its own position there (`task_stream`)."""
    if len(envs) == 1:
        for task in task_stream(envs[0].env, seed, start=start):
            yield Drawn(envs[0], task, task.id)
        return
    # The draw has a stream of its own, so that which environment comes next never depends on
    # how many tasks the others generated, and a resume replays the draws before `start` alone
    # to learn each environment's position there.
    picks = random.Random(f"fleetrl-envs-{seed}")
    weights = [run_env.weight for run_env in envs]
    positions = [0] * len(envs)
    for _ in range(start):
        positions[picks.choices(range(len(envs)), weights)[0]] += 1
    # Each environment draws from a seed of its own: two entries of one environment (other
    # options, or the same) would otherwise give the same tasks at the same positions.
    streams = [task_stream(run_env.env, entry_seed(seed, run_env.name), start=position)
               for run_env, position in zip(envs, positions, strict=True)]
    while True:
        (index,) = picks.choices(range(len(envs)), weights)
        task = next(streams[index], None)
        if task is None:  # that environment's tasks ran out: so does the run's stream
            return
        yield Drawn(envs[index], task, f"{envs[index].name}/{task.id}")
