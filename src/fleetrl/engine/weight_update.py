"""A weight update inside one worker rank, engine-neutral: the transport's receiver (the one the
init names, through the registry of fleetrl/transports.py), the checksum of what arrived, the
load pipeline (engine/load_pipeline.py), an adapter update's folder, and the seconds spent in
each phase. What an engine does with the tensors it is handed (vLLM's layerwise reload, in
engine/weight_receiver.py) comes in through `EngineSide`; a second engine reuses the rest.

The order of one update: `init` (the receiver joins), `start` (the engine opens its reload, or
an adapter update starts collecting), `receive` once per update record (batches of tensors go
into the pipeline: hashed, then loaded, each on a thread of its own), `finish` (waits for the
last load, closes the reload or writes the adapter, keeps the checksum). A failure anywhere
aborts: the reload is closed so the model is whole again, and the checksum cleared.

An adapter update (a LoRA run's, target "adapter") leaves the model alone: its tensors, a few
MiB, are kept as they arrive and hashed alike, then checked against the adapter's config and
written whole into the server's adapter folder (fleetrl/lora.py, $FLEETRL_ADAPTER_DIR) before
the update finishes; the engine loads the adapter again from that folder.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from fleetrl.contract import WEIGHT_UPDATE_PHASES
from fleetrl.engine.load_pipeline import LoadPipeline
from fleetrl.lora import ADAPTER_DIR_ENV, ADAPTER_NAME, AdapterSpec, check_complete, write_weights
from fleetrl.transports import Receiver, spec
from fleetrl.weights.checksum import WeightsHasher
from fleetrl.weights.wire import InitInfo, UpdateInfo, parse_update

Tensors = list[tuple[str, torch.Tensor]]
T = TypeVar("T")
_END = object()  # what `next` gives back once an iterator is spent


class EngineSide(Protocol):
    """What an engine does with a full-model update (target "model")."""

    def before_update(self) -> None:
        """As any update starts, the model's or an adapter's: drop what the old weights made."""

    def open_reload(self) -> None:
        """Before the first tensor of a model update."""

    def load(self, tensors: Tensors) -> None:
        """Tensors of a model update, in send order, on the pipeline's load thread."""

    def close_reload(self) -> None:
        """After the last tensor, or after a failure: the model whole again."""


class WeightUpdates:
    def __init__(self, engine: EngineSide) -> None:
        self._engine = engine
        self._receiver: Receiver | None = None  # of the transport the init named
        self._transport = ""  # its name, which reads the update records
        self._adapter_folder: Path | None = None  # set while the init names the adapter as its target
        self._adapter: Tensors | None = None  # an open adapter update's tensors
        self.checksum: str | None = None  # of the last completed update
        self.received_at: float | None = None  # when it completed (Unix time)
        self.received_bytes: int | None = None  # the tensor bytes it received
        # Seconds in each phase (`_timed`) of the last completed update, and of the open one:
        # the publish profile of docs/benchmarks.md.
        self.phases: dict[str, float] = {}
        self._open_phases: dict[str, float] = {}
        self._hasher: WeightsHasher | None = None  # set while an update is open
        # Made at the first update and kept: see load_pipeline.py for why its threads live
        # across updates.
        self._pipeline: LoadPipeline[Tensors] | None = None

    def init(self, init_info: InitInfo, worker_rank: int, serves_adapters: bool) -> None:
        """(Re)joins: a new init replaces the previous receiver (the worker set changed).
        `worker_rank`: this rank's place among its worker's ranks; `serves_adapters`: whether
        the engine was started to serve LoRA adapters."""
        self.shutdown()
        self._adapter_folder = _adapter_folder_for(init_info.target, serves_adapters)
        self._receiver = spec(init_info.transport).receiver_class().join(init_info, worker_rank)
        self._transport = init_info.transport

    def start(self) -> None:
        if self._receiver is None:
            raise RuntimeError("fleetrl weight receiver: start_weight_update before init_weight_transfer_engine")
        self._open_phases = dict.fromkeys(WEIGHT_UPDATE_PHASES, 0.0)
        with self._timed("start"):
            self._engine.before_update()
            if self._adapter_folder is None:
                self._engine.open_reload()
            else:
                self._adapter = []
        self._hasher = WeightsHasher()
        if self._pipeline is None:
            self._pipeline = LoadPipeline(self._hash, self._load)
        self.checksum = None  # the weights are in flux until finish

    def parse_update(self, update_dict: dict[str, Any]) -> UpdateInfo:
        if self._receiver is None:
            raise RuntimeError("fleetrl weight receiver: update_weights before init_weight_transfer_engine")
        return parse_update(self._transport, update_dict)

    def receive(self, update_info: UpdateInfo) -> None:
        """Returns once the record's tensors are in; they are hashed and loaded on the
        pipeline's threads, while the next record's arrive."""
        if self._hasher is None:
            raise RuntimeError("fleetrl weight receiver: update_weights outside start/finish_weight_update")
        try:
            for batch in self._timed_each("receive", self._receiver.receive(update_info)):
                self._submit(batch)
        except BaseException:
            self._abort()
            raise

    def finish(self) -> None:
        if self._hasher is None:
            raise RuntimeError("fleetrl weight receiver: finish_weight_update without an open update")
        try:
            with self._timed("wait"):
                self._pipeline.drain()
        except BaseException:
            self._abort()
            raise
        with self._timed("finalize"):
            if self._adapter is None:
                self._engine.close_reload()
            else:
                try:
                    self._write_adapter()
                except BaseException:
                    self._abort()
                    raise
        self.checksum = self._hasher.hexdigest()
        self.received_bytes = self._hasher.bytes
        self.received_at = time.time()
        self.phases = self._open_phases
        self._hasher = None

    @property
    def updating(self) -> bool:
        """An update is open: between start and its finish (or failure)."""
        return self._hasher is not None

    @property
    def group_name(self) -> str:
        """The broadcast group this rank has joined (its receiver's state); "" if none."""
        return self._receiver.state if self._receiver is not None else ""

    def shutdown(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    # -- the pipeline's stages (hash and load run on its threads) ----------------------------

    def _submit(self, tensors: Tensors) -> None:
        with self._timed("wait"):  # for earlier items while the pipeline is full
            self._pipeline.submit(tensors)

    def _hash(self, tensors: Tensors) -> None:
        with self._timed("hash"):
            self._hasher.update_all(tensors)  # on a GPU, each tensor is copied to the host to be hashed

    def _load(self, tensors: Tensors) -> None:
        with self._timed("load"):
            if self._adapter is None:
                self._engine.load(tensors)
            else:
                self._adapter.extend(tensors)

    # -- adapter updates and failures ----------------------------------------------------------

    def _write_adapter(self) -> None:
        """The adapter, checked against the config and the tensors of the folder it replaces,
        written whole."""
        where = f"adapter update into {self._adapter_folder}"
        AdapterSpec.of_folder(self._adapter_folder).check(self._adapter, where)
        check_complete(self._adapter_folder, self._adapter, where)
        write_weights(self._adapter_folder, self._adapter)
        self._adapter = None

    def _abort(self) -> None:
        """Close the reload after a failed update so the model is whole again: layers that
        received nothing get their previous weights back; the rest hold a mix, which is why
        the checksum is cleared (the worker holds no known version until a full update).
        The receiver drops what the sender sets up again (a broken broadcast group)."""
        self._hasher = None
        self.checksum = None
        if self._pipeline is not None:
            self._pipeline.cancel()  # nothing loads into the model while the reload closes
        if self._adapter is None:
            self._engine.close_reload()
        self._adapter = None  # the folder still holds the adapter before this update: it is written whole or not
        if self._receiver is not None:
            self._receiver.reset_on_failure()

    @contextmanager
    def _timed(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self._open_phases[phase] += time.perf_counter() - started

    def _timed_each(self, phase: str, items: Iterator[T]) -> Iterator[T]:
        """`items`, with the time taken to produce each one counted in `phase`."""
        while True:
            with self._timed(phase):
                item = next(items, _END)
            if item is _END:
                return
            yield item


def _adapter_folder_for(target: str, serves_adapters: bool) -> Path | None:
    if target == "model":
        return None
    folder = os.environ.get(ADAPTER_DIR_ENV)
    if not folder or not serves_adapters:
        raise RuntimeError(
            "fleetrl weight receiver: an adapter update needs a server started with LoRA enabled (vLLM: "
            f"--enable-lora), an adapter named {ADAPTER_NAME} among its adapters (--lora-modules), and "
            f"${ADAPTER_DIR_ENV} set to that adapter's folder")
    return Path(folder)
