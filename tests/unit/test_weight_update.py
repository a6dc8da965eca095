"""The engine-neutral side of a worker rank's weight update (engine/weight_update.py), driven
with a stand-in engine instead of vLLM: what a second engine would reuse."""

from __future__ import annotations

import pytest
import torch

from fleetrl.contract import WEIGHT_UPDATE_PHASES
from fleetrl.engine.weight_update import WeightUpdates
from fleetrl.weights.checksum import checksum_of
from fleetrl.weights.filesystem.manifest import MANIFEST, write_version
from fleetrl.weights.filesystem.wire import FilesystemInit, ManifestInfo

from .test_weights import sample_tensors


class RecordingEngine:
    """An engine that keeps what it is handed, in order, and the calls of its side."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[str] = []
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.fail_on = fail_on

    def before_update(self) -> None:
        self.calls.append("before_update")

    def open_reload(self) -> None:
        self.calls.append("open_reload")

    def load(self, tensors) -> None:
        if any(name == self.fail_on for name, _ in tensors):
            raise RuntimeError(f"cannot load {self.fail_on}")
        self.loaded.extend(tensors)

    def close_reload(self) -> None:
        self.calls.append("close_reload")


def published(tmp_path) -> dict:
    manifest = write_version(tmp_path, 1, iter(sample_tensors()), 1 << 20)
    return ManifestInfo(manifest=str(manifest.folder / MANIFEST)).to_dict()


def test_an_update_loads_in_order_and_keeps_the_checksum(tmp_path):
    engine = RecordingEngine()
    updates = WeightUpdates(engine)
    updates.init(FilesystemInit(), 0, serves_adapters=False)
    updates.start()
    assert updates.updating and updates.checksum is None
    updates.receive(updates.parse_update(published(tmp_path)))
    updates.finish()
    assert engine.calls == ["before_update", "open_reload", "close_reload"]
    assert [name for name, _ in engine.loaded] == [name for name, _ in sample_tensors()]
    assert updates.checksum == checksum_of(sample_tensors()) and not updates.updating
    assert list(updates.phases) == list(WEIGHT_UPDATE_PHASES) and updates.group_name == ""


def test_a_failed_load_closes_the_reload_and_clears_the_checksum(tmp_path):
    engine = RecordingEngine(fail_on="scale")
    updates = WeightUpdates(engine)
    updates.init(FilesystemInit(), 0, serves_adapters=False)
    updates.start()
    with pytest.raises(RuntimeError, match="cannot load scale"):  # from a later submit, or the finish
        updates.receive(updates.parse_update(published(tmp_path)))
        updates.finish()
    assert engine.calls == ["before_update", "open_reload", "close_reload"]
    assert updates.checksum is None and not updates.updating


def test_an_adapter_update_needs_an_engine_serving_adapters():
    with pytest.raises(RuntimeError, match="adapter update needs"):
        WeightUpdates(RecordingEngine()).init(FilesystemInit(target="adapter"), 0, serves_adapters=False)
