"""The receiver's load pipeline (engine/load_pipeline.py): order, overlap, bounds, failures.

Hermetic: the stages are plain functions; the real receiver runs it inside vLLM workers in
tests/integration/test_weight_transfer.py.
"""

from __future__ import annotations

import threading

import pytest

from fleetrl.engine.load_pipeline import LoadPipeline


def test_every_item_is_hashed_then_loaded_in_order_on_threads_of_their_own():
    events: list[tuple[str, int, str]] = []
    pipeline = LoadPipeline(lambda i: events.append(("hash", i, threading.current_thread().name)),
                            lambda i: events.append(("load", i, threading.current_thread().name)))
    for item in range(20):
        pipeline.submit(item)
    pipeline.drain()
    assert [i for stage, i, _ in events if stage == "hash"] == list(range(20))
    assert [i for stage, i, _ in events if stage == "load"] == list(range(20))
    order = [event[:2] for event in events]
    for item in range(20):  # an item's load comes after its hash
        assert order.index(("hash", item)) < order.index(("load", item))
    threads = {stage: {name for s, _, name in events if s == stage} for stage in ("hash", "load")}
    assert len(threads["hash"]) == len(threads["load"]) == 1
    assert threads["hash"] != threads["load"] and threading.current_thread().name not in threads["hash"] | threads["load"]


def test_submit_returns_while_an_earlier_item_still_loads_and_waits_once_depth_items_are_in_flight():
    release = threading.Event()
    loading = threading.Event()

    def load(item):
        loading.set()
        assert release.wait(10)

    pipeline = LoadPipeline(lambda i: None, load, depth=2)
    pipeline.submit(0)
    assert loading.wait(10)  # item 0 is loading ...
    pipeline.submit(1)  # ... and the receiver takes in item 1 meanwhile
    third = threading.Thread(target=pipeline.submit, args=(2,))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # two in flight: the third waits for the first to load
    release.set()
    third.join(10)
    assert not third.is_alive()
    pipeline.drain()


@pytest.mark.parametrize("stage", ["hash", "load"])
def test_a_failure_stops_later_loads_and_is_raised_by_the_next_submit_or_the_drain(stage):
    loaded = []

    def fail_on_3(item):
        if item == 3:
            raise ValueError(f"{stage} of item 3 failed")

    hash_item = fail_on_3 if stage == "hash" else (lambda i: None)
    load_item = (lambda i: (fail_on_3(i), loaded.append(i))) if stage == "load" else loaded.append
    pipeline = LoadPipeline(hash_item, load_item, depth=2)
    raised = None
    try:
        for item in range(10):
            pipeline.submit(item)
        pipeline.drain()
    except ValueError as error:
        raised = error
    else:
        pytest.fail("the failure of item 3 was not raised")
    finally:
        pipeline.cancel()
    assert str(raised) == f"{stage} of item 3 failed"
    assert loaded == [0, 1, 2]  # nothing after the failed item reached the model


def test_cancel_waits_for_the_load_in_progress_and_drops_the_rest():
    started, release = threading.Event(), threading.Event()
    loaded = []

    def load(item):
        started.set()
        assert release.wait(10)
        loaded.append(item)

    pipeline = LoadPipeline(lambda i: None, load, depth=5)
    for item in range(4):
        pipeline.submit(item)
    assert started.wait(10)
    threading.Timer(0.2, release.set).start()
    pipeline.cancel()  # returns only once item 0's load is done: nothing loads after it
    assert loaded == [0]


def test_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="depth must be at least 1"):
        LoadPipeline(lambda i: None, lambda i: None, depth=0)


def test_after_a_failure_the_pipeline_takes_the_next_update_on_the_same_threads():
    threads: set[str] = set()

    def load(item):
        threads.add(threading.current_thread().name)
        if item == "bad":
            raise ValueError("bad item")

    pipeline = LoadPipeline(lambda i: None, load)
    pipeline.submit("bad")
    with pytest.raises(ValueError, match="bad item"):
        pipeline.drain()
    for item in range(3):  # the next update
        pipeline.submit(item)
    pipeline.drain()
    assert len(threads) == 1  # one load thread, kept across updates
