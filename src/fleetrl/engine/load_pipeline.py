"""The receiver's pipeline: what a worker rank receives is hashed, then loaded, each on a
thread of its own, so the rank takes in bucket n+1 while it hashes and loads bucket n.

Why: the sender waits, bucket by bucket, until every worker's update_weights call returns.
When that call returned only after the rank had hashed and loaded the bucket, the sender, the
wire and the workers took turns, and a publish cost receive + hash + load summed over the
buckets (docs/benchmarks.md, "Where a publish goes"). Now the call returns once the bytes are
in, and the three stages run at once on different buckets:

    main thread   receive 1 | receive 2 | receive 3 | ...           | finish: wait, finalize
    hash thread               hash 1    | hash 2    | hash 3 | ...
    load thread                           load 1    | load 2 | load 3 ...

Order is kept: each stage is one thread taking items first in, first out, so the checksum is
over the tensors in send order and the layerwise reload sees them in order. A bucket is loaded
only after it is hashed, so the checksum is always of the bytes as they arrived, whatever a
weight loader does with them.

Memory: `submit` waits while `depth` items are still being hashed or loaded, so a rank holds at
most `depth` + 1 buckets beyond the layers the reload has in flight.

Failures: after a hash or a load raises, nothing more is loaded; the next `submit`, or `drain`,
raises that error, and `cancel` waits for what is running and drops the rest.

The two threads live as long as the pipeline (the receiver's: the worker's), across updates:
a rank that started fresh threads for every update loaded about twice as slowly (measured on
vLLM CPU workers: each new thread starts with cold per-thread state, its allocator arena and
the kernels' caches).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Generic, TypeVar

T = TypeVar("T")


class LoadPipeline(Generic[T]):
    def __init__(self, hash_item: Callable[[T], None], load_item: Callable[[T], None], depth: int = 2) -> None:
        """The threads start with the first item, on the CPUs of the thread that makes the
        pipeline: vLLM binds a CPU worker's whole process to its cores."""
        if depth < 1:
            raise ValueError(f"load pipeline depth must be at least 1, not {depth}")
        self._hash_item = hash_item
        self._load_item = load_item
        self._depth = depth
        self._hash_thread = ThreadPoolExecutor(1, thread_name_prefix="fleetrl-hash")
        self._load_thread = ThreadPoolExecutor(1, thread_name_prefix="fleetrl-load")
        self._in_flight: deque[Future[None]] = deque()  # each item's load, oldest first
        self._failed = threading.Event()  # set at the first failure: later items are skipped until drained

    def submit(self, item: T) -> None:
        """Queues `item` to be hashed, then loaded. Raises the failure of an earlier item
        instead; waits while `depth` items are in flight."""
        while self._in_flight and (self._in_flight[0].done() or len(self._in_flight) >= self._depth):
            self._in_flight.popleft().result()
        hashed = self._hash_thread.submit(self._run, self._hash_item, item)
        self._in_flight.append(self._load_thread.submit(self._load_after, hashed, item))

    def drain(self) -> None:
        """Waits until every item is loaded; raises the first failure. The pipeline is then
        empty and takes the next update's items."""
        try:
            while self._in_flight:
                self._in_flight.popleft().result()
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stops loading: waits for the item a thread is working on and drops the rest (their
        failures are not raised). The pipeline is then empty and takes new items."""
        self._failed.set()  # what is still queued is skipped at once
        while self._in_flight:
            wait([self._in_flight.popleft()])
        self._failed.clear()

    def _run(self, step: Callable[[T], None], item: T) -> None:
        if self._failed.is_set():
            raise RuntimeError("load pipeline: an earlier item failed; this one was not processed")
        try:
            step(item)
        except BaseException:
            self._failed.set()
            raise

    def _load_after(self, hashed: Future[None], item: T) -> None:
        hashed.result()  # the hash's failure is this item's
        self._run(self._load_item, item)
