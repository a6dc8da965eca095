"""Imports of the heavy libraries (torch, transformers, vLLM, Dynamo) with Python's cyclic
garbage collector paused, then the heap frozen. Their import allocates millions of objects that
live as long as the process, and the collector, triggered by the count of new objects, scans the
growing heap again and again meanwhile: a third of a vLLM server's import on this machine
(docs/benchmarks.md, "Imports without the garbage collector"). One collection then frees what
the imports threw away, and what is left is frozen (`gc.freeze`): it stays out of every later
scan, and a process forked after it (an engine core) shares its memory pages instead of copying
them when its collector runs, the pattern Python's `gc.freeze` documents."""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """The block's imports with the collector paused; then one collection, everything left on
    the heap frozen, and the collector resumed (if it ran before). At exit the heap is unfrozen:
    the interpreter's last collection frees it as it would have, and an extension that counts
    its objects then (triton's nanobind) finds none leaked."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # once, however many blocks a process runs
        atexit.register(gc.unfreeze)
        if running:
            gc.enable()
