"""Imports of the heavy libraries (torch, transformers, vLLM, Dynamo) with Python's cyclic
garbage collector paused, then the heap they made frozen. Their import allocates millions of
objects that live as long as the process, and the collector, triggered by the count of new
objects, scans the growing heap again and again meanwhile: a third of a vLLM server's import
on this machine (docs/benchmarks.md, "Imports without the garbage collector"). Frozen
(`gc.freeze`), those objects stay out of every later scan, and a process forked after it (an
engine core) shares their memory pages instead of copying them when its collector runs: the
pattern Python's `gc.freeze` documents."""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """The block's imports with the collector paused; what is on the heap after them is frozen,
    and the collector resumes (if it ran before). At exit the heap is unfrozen: the
    interpreter's last collection frees it as it would have, and an extension that counts its
    objects then (triton's nanobind) finds none leaked."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        atexit.register(gc.unfreeze)
        if running:
            gc.enable()
