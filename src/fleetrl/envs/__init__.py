"""Environments by name: the built-in tasks (single-turn: reverse_text, arithmetic; multi-turn:
arithmetic_retry; with a tool: calculator), and any `verifiers` taskset as `verifiers:<id>`."""

from __future__ import annotations

import inspect

from fleetrl.envs.arithmetic import Arithmetic
from fleetrl.envs.arithmetic_retry import ArithmeticRetry
from fleetrl.envs.base import (Environment, EnvError, MultiTurnEnvironment, Rollout, Task, env_tools, is_multi_turn,
                               respond, score, task_stream)
from fleetrl.envs.calculator import Calculator
from fleetrl.envs.reverse_text import ReverseText

BUILTIN = {env.name: env for env in (ReverseText, Arithmetic, ArithmeticRetry, Calculator)}
VERIFIERS_PREFIX = "verifiers:"

__all__ = ["Environment", "EnvError", "MultiTurnEnvironment", "Rollout", "Task", "env_tools", "get_environment",
           "is_multi_turn", "respond", "score", "task_stream"]


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
