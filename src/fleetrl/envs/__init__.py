"""Environments by spec (`orchestrator.env`, an entry's `env`), resolved in this order: a built-in
name (BUILTIN: single-turn reverse_text, arithmetic, dataset; multi-turn arithmetic_retry; with a
tool, calculator); a prefix of PREFIXES (`verifiers:<taskset id>`, a taskset of the `verifiers`
library; `reasoning_gym:<dataset>`); `module.path:Attr`, any other spec with a colon, imported
with the current directory on sys.path after the installed packages (envs/imports.py, so a
package beside the user's configs works uninstalled); a name an installed package registers in
the entry-point group `fleetrl.environments` (a built-in name wins over a registered one; two
packages registering one name is an error). `Attr`, by import path or entry point, is a class or
a factory (any callable), called with the options as keyword arguments, and what it makes is
checked against the contract (`check_contract`). Every failure is an `EnvError` of one line that
names the spec."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from fleetrl.envs.arithmetic import Arithmetic
from fleetrl.envs.arithmetic_retry import ArithmeticRetry
from fleetrl.envs.base import (Environment, EnvError, MultiTurnEnvironment, Rollout, Task, env_tools, is_multi_turn,
                               one_line, respond, score, task_stream)
from fleetrl.envs.calculator import Calculator
from fleetrl.envs.dataset import DatasetEnvironment  # imports `datasets` only when built
from fleetrl.envs.imports import load_attribute
from fleetrl.envs.reasoning_gym import ReasoningGymEnvironment  # imports reasoning_gym only when built
from fleetrl.envs.reverse_text import ReverseText
from fleetrl.envs.tools import Tool

BUILTIN = {env.name: env for env in (ReverseText, Arithmetic, ArithmeticRetry, Calculator, DatasetEnvironment)}
ENTRY_POINT_GROUP = "fleetrl.environments"


def verifiers_environment(taskset_id: str, **options: Any) -> Environment:
    # Imported here: `verifiers` is an optional, heavy dependency only these envs need.
    from fleetrl.envs.verifiers_adapter import VerifiersEnvironment

    return VerifiersEnvironment(taskset_id, **options)


# Spec prefix -> (what follows it, in the list of known forms; its factory, called with that
# rest of the spec and the options, which it checks itself).
PREFIXES: dict[str, tuple[str, Callable[..., Environment]]] = {
    "verifiers:": ("taskset id", verifiers_environment),
    "reasoning_gym:": ("dataset", ReasoningGymEnvironment),
}

__all__ = ["Environment", "EnvError", "MultiTurnEnvironment", "Rollout", "Task", "check_contract", "env_tools",
           "get_environment", "is_multi_turn", "respond", "score", "task_stream"]


def get_environment(spec: str, **options: Any) -> Environment:
    """The environment `spec` names (the module's docstring), built with `options` and checked
    against the contract."""
    where = f"env {spec}"
    prefix = next((p for p in PREFIXES if spec.startswith(p)), None)
    if spec in BUILTIN:
        env = construct(where, BUILTIN[spec], options)
    elif prefix is not None:
        env = PREFIXES[prefix][1](spec.removeprefix(prefix), **options)
    elif ":" in spec:
        module, _, attr = spec.partition(":")
        env = construct(where, load_attribute(where, module, attr), options)
    else:
        registered = registered_environments().get(spec)
        if not registered:
            raise EnvError(unknown_message(spec))
        if len(registered) > 1:
            raise EnvError(f"{where}: registered by two installed packages, {dist_name(registered[0])} "
                           f"({registered[0].value}) and {dist_name(registered[1])} ({registered[1].value}): "
                           f"uninstall one, or name the environment by its import path")
        entry = registered[0]
        where = f"env {spec} ({entry.value}, from {dist_name(entry)})"
        env = construct(where, load_attribute(where, entry.module, entry.attr), options)
    check_contract(env, where)
    return env


def unknown_message(spec: str) -> str:
    registered = ", ".join(sorted(registered_environments())) or "none"
    forms = ", ".join(["module.path:Attr", *(f"{p}<{rest}>" for p, (rest, _) in PREFIXES.items())])
    return f"unknown environment '{spec}' (built-in: {', '.join(BUILTIN)}; registered: {registered}; or {forms})"


def registered_environments() -> dict[str, list[EntryPoint]]:
    """The names installed packages register in ENTRY_POINT_GROUP, each with its entry points
    (more than one: two packages claim the name)."""
    found: dict[str, list[EntryPoint]] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, []).append(entry)
    return found


def dist_name(entry: EntryPoint) -> str:
    return entry.dist.name if entry.dist is not None else "an unnamed distribution"


def construct(where: str, factory: Callable[..., Any], options: dict[str, Any]) -> Any:
    """`factory(**options)`: an option its signature does not take, or a required one missing, is
    refused before the call; a ValueError it raises is its reason to refuse the options, anything
    else it raises a failure of the factory."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the call checks the options
        parameters = None
    if parameters is not None and not any(p.kind is p.VAR_KEYWORD for p in parameters):
        accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if unknown := sorted(set(options) - set(accepted)):
            raise EnvError(f"{where}: unknown option '{unknown[0]}' (accepted: {', '.join(accepted) or 'none'})")
        required = [p.name for p in parameters
                    if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if missing := [name for name in required if name not in options]:
            raise EnvError(f"{where}: missing option '{missing[0]}'")
    try:
        return factory(**options)
    except EnvError:
        raise
    except ValueError as e:  # the message alone: it says what is wrong with the options
        reason = str(e).strip().splitlines()
        raise EnvError(f"{where}: {reason[0] if reason else one_line(e)}") from None
    except Exception as e:
        raise EnvError(f"{where}: {getattr(factory, '__qualname__', factory)}(...) raised {one_line(e)}") from e


def check_contract(env: Any, where: str) -> None:
    """The environment contract (fleetrl.envs.base), checked before a run starts: a `name`,
    `tasks` and `reward`; `respond` for a multi-turn one (it has `respond`, or lends `tools`),
    whose tools are `fleetrl.envs.tools.Tool`s; the optional methods, where present, callable."""
    name = getattr(env, "name", None)
    if not isinstance(name, str) or not name:
        raise EnvError(f"{where}: the environment has no name (a non-empty string attribute `name`)")
    for method in ("tasks", "reward"):
        if not callable(getattr(env, method, None)):
            raise EnvError(f"{where}: the environment has no {method}() method")
    for method in ("respond", "episode_ended", "eval_tasks", "tasks_from"):
        if hasattr(env, method) and not callable(getattr(env, method)):
            raise EnvError(f"{where}: its {method} is a {type(getattr(env, method)).__name__}, not a method")
    tools = getattr(env, "tools", None)
    if tools is None:
        return
    if not isinstance(tools, (list, tuple)):
        raise EnvError(f"{where}: its tools are a {type(tools).__name__}, not a list of fleetrl.envs.tools.Tool")
    for index, tool in enumerate(tools):
        if not isinstance(tool, Tool):
            raise EnvError(f"{where}: tools[{index}] is a {type(tool).__name__}, not a fleetrl.envs.tools.Tool")
    if tools and not is_multi_turn(env):
        raise EnvError(f"{where}: it lends tools but has no respond() method, which a multi-turn environment needs")
