"""Environments by name: the built-in tasks, and any `verifiers` taskset as `verifiers:<id>`."""

from __future__ import annotations

import inspect

from fleetrl.envs.arithmetic import Arithmetic
from fleetrl.envs.base import Environment, EnvError, Rollout, Task, score, task_stream
from fleetrl.envs.reverse_text import ReverseText

BUILTIN = {env.name: env for env in (ReverseText, Arithmetic)}
VERIFIERS_PREFIX = "verifiers:"

__all__ = ["Environment", "EnvError", "Rollout", "Task", "get_environment", "score", "task_stream"]


def get_environment(name: str, **options) -> Environment:
    """The environment called `name`, built with `options` (its constructor's keyword arguments)."""
    if name.startswith(VERIFIERS_PREFIX):
        # Imported here: `verifiers` is an optional, heavy dependency only these envs need.
        from fleetrl.envs.verifiers_adapter import VerifiersEnvironment

        return VerifiersEnvironment(name.removeprefix(VERIFIERS_PREFIX), **options)
    if name not in BUILTIN:
        known = ", ".join([*BUILTIN, f"{VERIFIERS_PREFIX}<taskset id>"])
        raise EnvError(f"unknown environment '{name}' (known: {known})")
    cls = BUILTIN[name]
    accepted = list(inspect.signature(cls).parameters)
    if unknown := sorted(set(options) - set(accepted)):
        raise EnvError(f"env {name}: unknown option '{unknown[0]}' (accepted: {', '.join(accepted) or 'none'})")
    try:
        return cls(**options)
    except ValueError as e:
        raise EnvError(f"env {name}: {e}") from None
