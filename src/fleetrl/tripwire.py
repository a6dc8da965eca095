"""A tripwire for process-wide state set off the main thread. torch's default dtype and device, its
seed, and the init patches transformers and accelerate apply while they build a model hold for
the whole process, so one set on the control loop's thread changes under the trainer on the main
thread. With `FLEETRL_TRIPWIRE=1`, `fleetrl` (cli.main) and each trainer rank run their command
through `run_armed`, which wraps each setter in GUARDED: a call from another thread is printed
with its stack, raises TripwireError there, and ends the command with exit status 1. Without the
variable nothing is wrapped. The cases it guards, and the tests: docs/reliability.md, "Never
mis-versioned"."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator

from fleetrl.errors import FleetrlError

ENV = "FLEETRL_TRIPWIRE"
# (module, function or Class.method): what sets state for the whole process. A function is replaced
# wherever a loaded module holds it (`from accelerate import init_empty_weights` copies one); a
# method on its class, where every subclass finds it.
GUARDED = (
    ("torch", "set_default_dtype"),
    ("torch", "set_default_tensor_type"),  # sets the default dtype too
    ("torch", "set_default_device"),
    ("torch", "manual_seed"),
    # transformers' no-init context and its siblings: each patches torch or PreTrainedModel process-wide.
    ("transformers.initialization", "no_init_weights"),
    ("transformers.initialization", "no_tie_weights"),
    ("transformers.initialization", "meta_device_safe_creation_ops"),
    ("accelerate.big_modeling", "init_empty_weights"),
    ("accelerate.big_modeling", "init_on_device"),
    # Every transformers model build runs PreTrainedModel.__init__, and its weight init swaps
    # torch.nn.init's functions process-wide (guard_torch_init_functions, which holds torch's own
    # by value: only its callers can be guarded). initialize_weights is also called on a built model.
    ("transformers.modeling_utils", "PreTrainedModel.__init__"),
    ("transformers.modeling_utils", "PreTrainedModel.initialize_weights"),
)


class TripwireError(FleetrlError):
    """A process-wide setter called from a thread other than the main one."""


class Tripwire:
    """The offences of one armed command, each a line naming the function and the thread."""

    def __init__(self) -> None:
        self.offences: list[str] = []
        self._lock = threading.Lock()

    def trip(self, name: str, thread: threading.Thread) -> None:
        offence = (f"tripwire: {name} called on thread {thread.name}: it changes process-wide state, which "
                   "fleetrl changes on the main thread only")
        with self._lock:
            self.offences.append(offence)
        stack = "".join(traceback.format_stack()[:-2])  # to the call, without the wrapper's frames
        print(f"fleetrl: {offence}\n{stack}", file=sys.stderr, flush=True)
        raise TripwireError(offence)

    def verdict(self) -> str | None:
        """The command's one line when anything tripped: the first offence (and how many)."""
        with self._lock:
            if not self.offences:
                return None
            more = len(self.offences) - 1
            return self.offences[0] + (f" ({more} more offence(s), each printed with its stack)" if more else "")


_armed: Tripwire | None = None  # the tripwire the wrappers report to, while a command is armed


def _guarded(name: str, setter):
    @functools.wraps(setter)
    def call(*args, **kwargs):
        wire, thread = _armed, threading.current_thread()
        if wire is not None and thread is not threading.main_thread():
            wire.trip(name, thread)
        return setter(*args, **kwargs)

    return call


class _Wrapping:
    """The setters of GUARDED replaced by wrappers wherever a loaded module holds them, and put
    back by `undo`. A guarded module not yet imported is wrapped once it has run, before any module
    that imports it can copy a setter: importing transformers and accelerate up front would cost
    every command a second (`fleetrl verify`, `status` and `model` load neither)."""

    def __init__(self) -> None:
        self.wrapped: list[tuple[type | None, str, object, object]] = []  # (class or None, name, setter, wrapper)
        self.pending = {module for module, _ in GUARDED if module not in sys.modules}

    def wrap(self, module: types.ModuleType) -> None:
        for module_name, name in GUARDED:
            if module_name == module.__name__:
                owner, _, attribute = name.rpartition(".")
                cls = getattr(module, owner) if owner else None
                setter = cls.__dict__[attribute] if cls is not None else getattr(module, attribute)
                wrapper = _guarded(f"{module_name}.{name}", setter)
                self.wrapped.append((cls, attribute, setter, wrapper))
                _replace(cls, attribute, setter, wrapper)

    def find_spec(self, fullname, path, target=None):
        """A meta path finder for the pending modules: the spec the other finders give, whose
        loader wraps the module's setters once it has run."""
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    self.pending.discard(fullname)
                    self.wrap(module)

                spec.loader.exec_module = exec_module
                return spec
        return None

    def undo(self) -> None:
        """The setters back, in every module that holds a wrapper (those that copied one since
        too). One that another library wrapped meanwhile (torch._dynamo wraps torch.manual_seed)
        keeps calling a wrapper, which does nothing more once disarmed."""
        for cls, name, setter, wrapper in reversed(self.wrapped):
            _replace(cls, name, wrapper, setter)


def _replace(cls: type | None, name: str, old, new) -> None:
    """`new` for `old` as `name`: the method of `cls`, or (None) in every loaded module."""
    if cls is not None:
        setattr(cls, name, new)
        return
    for holder in list(sys.modules.values()):
        if isinstance(holder, types.ModuleType) and holder.__dict__.get(name) is old:
            setattr(holder, name, new)


@contextlib.contextmanager
def armed(enabled: bool) -> Iterator[Tripwire]:
    """Every setter in GUARDED wrapped while inside (when `enabled`; from the main thread, before
    the command starts its threads); yields the Tripwire that records the offences."""
    global _armed
    wire = Tripwire()
    if not enabled:
        yield wire
        return
    if threading.current_thread() is not threading.main_thread() or _armed is not None:
        raise RuntimeError("the tripwire is armed once, from the main thread")
    wrapping = _Wrapping()
    for module_name in {module for module, _ in GUARDED} - wrapping.pending:
        wrapping.wrap(sys.modules[module_name])
    sys.meta_path.insert(0, wrapping)
    _armed = wire
    try:
        yield wire
    finally:
        _armed = None
        sys.meta_path.remove(wrapping)
        wrapping.undo()


def run_armed(command: Callable[[], int]) -> int:
    """`command`'s exit status, run armed when FLEETRL_TRIPWIRE=1 (call it from the main thread,
    before any thread starts); 1, with a line naming the first offence, when anything tripped."""
    with armed(os.environ.get(ENV) == "1") as wire:
        code = command()
    if (offence := wire.verdict()) is not None:
        print(f"fleetrl: error: {offence}", file=sys.stderr)
        return 1
    return code
