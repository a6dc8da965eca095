"""fleetrl.heavy_imports: the collector paused inside the block, the garbage of the block
collected and the rest of the heap frozen after it, and the collector's state before the block
restored (on, or left off by a caller)."""

import gc
import importlib
import weakref

import pytest

from fleetrl.heavy_imports import imports_without_gc


class Cyclic:
    """A weakly referable object that keeps itself alive through a reference cycle."""

    def __init__(self, cycle: list) -> None:
        self.cycle = cycle
        cycle.append(self)


@pytest.mark.parametrize("running", [True, False])
def test_the_collector_is_paused_then_restored_and_the_heap_frozen(running):
    (gc.enable if running else gc.disable)()
    try:
        frozen = gc.get_freeze_count()
        with imports_without_gc():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]  # tracked objects allocated while paused
        assert gc.isenabled() is running
        assert gc.get_freeze_count() - frozen >= len(made)
    finally:
        gc.enable()


def test_what_the_block_threw_away_is_collected_not_frozen():
    with imports_without_gc():
        gone = weakref.ref(Cyclic([]))  # unreachable at once, and freed only by a collection
    assert gone() is None


def test_a_failing_import_still_restores_the_collector():
    gc.enable()
    with pytest.raises(ModuleNotFoundError), imports_without_gc():
        importlib.import_module("fleetrl_no_such_module")
    assert gc.isenabled()
