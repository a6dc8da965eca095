"""A recorder of changes to process-global state made off the main thread (issue 27, item 1).

`fleetrl rl` trains on the main thread while the fleet and the orchestrator run on the control
loop's thread (and the threads it starts: user code, transfers, an environment's own loop). What
one thread sets for the whole process (the environment variables, torch's defaults and seeds,
Python's and numpy's RNGs, signal handlers, the working directory, sys.path, logging, a model or
tokenizer load) changes under the other. Inside `recording()`, each known setter called from a
thread other than the main one is recorded, with the thread and the code that called it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import signal
import sys
import threading
import traceback

import numpy
import pytest
import torch


class Recorder:
    def __init__(self) -> None:
        self._calls: list[str] = []
        self._lock = threading.Lock()

    def note(self, setter: str) -> None:
        thread = threading.current_thread()
        if thread is threading.main_thread():
            return
        frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith("global_state.py")]
        # Where it was called, and the innermost of fleetrl's own frames (what led there).
        ours = next((f for f in reversed(frames) if "/fleetrl/" in f.filename), None)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" + (f", from {ours.filename}:{ours.lineno}" if ours else "")
        with self._lock:
            self._calls.append(f"{setter} on thread {thread.name} ({where})")

    def off_main(self) -> list[str]:
        with self._lock:
            return list(self._calls)


def _recorded(recorder: Recorder, setter: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        recorder.note(setter)
        return fn(*args, **kwargs)

    return call


SYS_PATH_CHANGES = ("append", "insert", "extend", "remove", "pop", "clear", "__setitem__", "__delitem__", "__iadd__")


def _recorded_sys_path(recorder: Recorder) -> list:
    """A copy of sys.path whose every change is recorded."""
    methods = {name: _recorded(recorder, f"sys.path.{name}", getattr(list, name)) for name in SYS_PATH_CHANGES}
    return type("RecordedPath", (list,), methods)(sys.path)


@contextlib.contextmanager
def recording():
    """Yields a Recorder of the setters below called off the main thread while inside."""
    recorder = Recorder()
    with pytest.MonkeyPatch.context() as patch:
        def record(owner, name: str, setter: str) -> None:
            patch.setattr(owner, name, _recorded(recorder, setter, getattr(owner, name)))

        record(type(os.environ), "__setitem__", "os.environ[...] =")
        record(type(os.environ), "__delitem__", "del os.environ[...]")
        for name in ("putenv", "unsetenv", "chdir", "sched_setaffinity"):
            record(os, name, f"os.{name}")
        for name in ("set_default_dtype", "set_default_device", "set_num_threads", "set_num_interop_threads",
                     "manual_seed", "seed", "use_deterministic_algorithms", "set_float32_matmul_precision"):
            record(torch, name, f"torch.{name}")
        for name in ("seed", "setstate"):
            record(random, name, f"random.{name}")
        record(numpy.random, "seed", "numpy.random.seed")
        for name in ("signal", "set_wakeup_fd"):
            record(signal, name, f"signal.{name}")
        for name in ("setLevel", "addHandler", "removeHandler"):
            record(logging.Logger, name, f"logging.Logger.{name}")
        record(logging, "disable", "logging.disable")
        patch.setattr(sys, "path", _recorded_sys_path(recorder))
        _record_loads(recorder, patch)
        yield recorder


def _record_loads(recorder: Recorder, patch: pytest.MonkeyPatch) -> None:
    """Every `from_pretrained` of transformers (models, tokenizers, configs): a model load
    patches module creation and torch's default dtype for the whole process while it runs."""
    from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    for owner in (AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, _BaseAutoModelClass,
                  PreTrainedTokenizerBase):
        load = owner.__dict__["from_pretrained"].__func__
        patch.setattr(owner, "from_pretrained", classmethod(_recorded(recorder, f"{owner.__name__}.from_pretrained",
                                                                      load)))
