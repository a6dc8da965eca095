"""What the orchestrator needs from an environment: prompts in, rewards out. An environment hands
out an endless, seeded stream of tasks and scores one rollout at a time with a reward in [0, 1];
a multi-turn one also answers the model's turns (`respond`) and may lend it `tools`. `score` and
`task_stream` wrap this user code: what it raises, and a reward that is not a finite number in
[0, 1], becomes an `EnvError` naming the environment and the task. The contract and how the
orchestrator calls it: docs/environments.md."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fleetrl.envs.tools import Tool
from fleetrl.errors import FleetrlError, one_line
from fleetrl.versions import VersionSpan


class EnvError(FleetrlError):
    """An environment failed or returned an unusable reward; the message names env and task."""


@dataclass(frozen=True)
class Task:
    id: str  # names the task in errors and records; the same seed yields the same ids
    messages: list[dict[str, str]]  # chat messages ({"role", "content"}) the prompt is rendered from
    answer: Any  # what `reward` judges against; its type is the environment's business


@dataclass(frozen=True)
class Rollout:
    """One completion of a task, with the policy versions that produced it."""

    task: Task
    completion: str  # the decoded completion text, special tokens removed
    spans: list[VersionSpan]  # as returned by the inference layer: the first starts at token 0
    step: int  # the trainer step whose batch this rollout is generated for
    # The whole conversation: the task's messages, then each model turn ("assistant") and each
    # answer of the environment or a tool ("user", "tool"). `completion` is the last model turn.
    messages: list[dict[str, str]] = field(default_factory=list)
    # Multi-turn episodes: the state its environment kept (`respond`), and where each model turn
    # lies in the episode's tokens after the prompt ([start, end); `spans` index the same tokens).
    state: dict[str, Any] = field(default_factory=dict)
    turns: list[list[int]] = field(default_factory=list)


class Environment(Protocol):
    """An environment may also define `eval_tasks(seed)`: its held-out split, which `tasks`
    never yields, for evaluation during training (`HeldOutSplit` makes one of a generator); and
    `tasks_from(seed, start)`: the tasks of `tasks(seed)` from position `start` on, made without
    generating those before it, which a resumed run seeks with (`task_stream`) rather than
    generating and skipping them."""

    name: str

    def tasks(self, seed: int) -> Iterator[Task]:
        """An endless stream of tasks; the same seed yields the same tasks in the same order."""
        ...

    def reward(self, rollout: Rollout) -> float:
        """How good the completion is, in [0, 1]."""
        ...


class MultiTurnEnvironment(Environment, Protocol):
    tools: list[Tool]  # may be empty: a multi-turn environment without tools

    def respond(self, task: Task, messages: list[dict[str, str]], state: dict[str, Any]) -> list[dict[str, str]] | None:
        """The environment's answer to the model's last turn (`messages[-1]`, which holds no
        tool call): messages to add before the model's next turn, or None: the episode is over.

        `state` is the episode's own dict, the same in every call and in its rollout's
        `state`: an environment keeps what it needs across turns there. fleetrl puts the
        episode's name (`state["episode"]`, unique in the run) and `state["step"]` in it.
        An environment may also define `episode_ended(task, state, end)`: called once when an
        episode ends, whatever ended it (`end`: docs/environments.md), before its reward.
        """
        ...


def is_multi_turn(env: Environment) -> bool:
    return callable(getattr(env, "respond", None))


def env_tools(env: Environment) -> list[Tool]:
    """The tools an environment lends the model (none for most)."""
    return list(getattr(env, "tools", None) or [])


def respond(env: MultiTurnEnvironment, task: Task, messages: list[dict[str, str]],
            state: dict[str, Any]) -> list[dict[str, str]] | None:
    """`env.respond(...)`, checked to be None or a non-empty list of chat messages."""
    turn = sum(m["role"] == "assistant" for m in messages[len(task.messages):])
    where = f"env {env.name}: answer to turn {turn} of task {task.id}"
    try:
        reply = env.respond(task, messages, state)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"{where} raised {one_line(e)}") from e
    if reply is None:
        return None
    if (not isinstance(reply, list) or not reply
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in reply)):
        raise EnvError(f"{where} is {str(reply)[:200]!r}, not None or a non-empty list of {{role, content}} messages")
    return reply


# The built-in environments' held-out split: one task in HELD_OUT_EVERY, chosen by a hash of its
# messages rather than by its position, so that no seed ever trains on it, and evaluation takes
# only those (`HeldOutSplit`).
HELD_OUT_EVERY = 10


def held_out(task: Task) -> bool:
    digest = hashlib.sha256(json.dumps(task.messages, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_EVERY == 0


class HeldOutSplit:
    """An environment that generates its tasks (`generate(seed)`) and keeps a held-out split of
    them: training (`tasks`) gets every task but those, evaluation (`eval_tasks`) those alone."""

    def generate(self, seed: int) -> Iterator[Task]:
        raise NotImplementedError

    def tasks(self, seed: int) -> Iterator[Task]:
        return (task for task in self.generate(seed) if not held_out(task))

    def eval_tasks(self, seed: int) -> Iterator[Task]:
        return (task for task in self.generate(seed) if held_out(task))


def eval_stream(env: Environment, seed: int, held_out_only: bool) -> Iterator[Task]:
    """The tasks an evaluation of `env` draws: its held-out split (`eval_tasks`), or, where the
    user named the environment for evaluation and it has none, its tasks (`held_out_only` False);
    an EnvError where a held-out split is needed and it has none."""
    if callable(getattr(env, "eval_tasks", None)):
        return task_stream(env, seed, split="eval_tasks")
    if held_out_only:
        raise EnvError(f"env {env.name} has no held-out split (eval_tasks): name what to evaluate on in "
                       "eval.envs")
    return task_stream(env, seed)


def task_stream(env: Environment, seed: int, split: str = "tasks", start: int = 0) -> Iterator[Task]:
    """`env.tasks(seed)` (or another `split`) from position `start` on (by `tasks_from` where the
    environment has it, else by skipping), with whatever the environment raises turned into an
    `EnvError`."""
    index = start  # of the task being generated, for the error message
    try:
        if split == "tasks" and start and callable(getattr(env, "tasks_from", None)):
            tasks = env.tasks_from(seed, start)
        else:
            tasks = itertools.islice(getattr(env, split)(seed), start, None)
        for task in tasks:
            yield task
            index += 1
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"env {env.name}: generating task {index} (seed {seed}) raised {one_line(e)}") from e


def score(env: Environment, rollout: Rollout) -> float:
    """`env.reward(rollout)`, checked to be a finite number in [0, 1]."""
    where = f"env {env.name}: reward of task {rollout.task.id}"
    try:
        value = env.reward(rollout)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"{where} raised {one_line(e)}") from e
    # bools and numpy's scalars (its bool_ too) are fine; None or a string ("0.5") is a bug in the env
    if not isinstance(value, numbers.Real | np.bool_):
        raise EnvError(f"{where} is {value!r}, not a number")
    reward = float(value)
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        raise EnvError(f"{where} is {reward!r}, outside [0, 1]")
    return reward
