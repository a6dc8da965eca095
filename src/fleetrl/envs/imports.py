"""Objects named by an import path, `module.path:attr`: users' environments (`orchestrator.env`)
and reward functions (`reward = "module.path:function"`). The module is imported with the
current directory on sys.path after the installed packages, as `python -m` does, so a module
beside the user's configs works without being installed."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from fleetrl.envs.base import EnvError
from fleetrl.errors import one_line


def load_attribute(where: str, module_name: str, attr: str) -> Any:
    """`attr` (dotted names allowed) of the module `module_name`, imported with the current
    directory on sys.path."""
    if not module_name or not attr:
        raise EnvError(f"{where}: expected module.path:Attr")
    cwd = os.getcwd()
    if cwd not in sys.path:  # after the installed packages: a local folder never shadows one
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(f"{e.name}.")):
            raise EnvError(f"{where}: cannot import module '{module_name}' ({one_line(e)}; looked in the installed "
                           f"packages and {cwd})") from None
        raise EnvError(f"{where}: importing module '{module_name}' raised {one_line(e)}") from e
    except Exception as e:
        raise EnvError(f"{where}: importing module '{module_name}' raised {one_line(e)}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvError(f"{where}: module '{module_name}' ({getattr(module, '__file__', None)}) has no attribute "
                           f"'{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EnvError(f"{where}: {module_name}:{attr} is a {type(obj).__name__}, not a class or a factory")
    return obj
