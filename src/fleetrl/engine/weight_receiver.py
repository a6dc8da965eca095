"""vLLM weight-transfer backend `fleetrl`: receives a policy version inside each worker rank.

vLLM drives it through its weight-transfer protocol (HTTP routes -> engine core ->
collective_rpc on every rank):

    /init_weight_transfer_engine {"init_info": {"transport": a registered name,
                                                "target": "model"|"adapter", ...}}
    /start_weight_update                     open vLLM's layerwise reload
    /update_weights {"update_info": {...}}   stream tensors into model.load_weights
    /finish_weight_update                    close the reload; keep the checksum

The infos are the wire records the sender builds them from (fleetrl.weights.wire). This
module is the vLLM side only; the receiver of the transport the init names (the registry's,
fleetrl/transports.py), which has no vLLM, takes the bytes in through one interface: it joins
at the init, yields each update's tensors in batches, resets after a failure, and says what it
holds (`state`: a broadcast group's name) for the sender to check.

Each rank hashes and loads what it received on threads of its own (`LoadPipeline`), so an
update_weights call returns once the bytes are in and the next bucket's broadcast overlaps
this one's hash and load; finish_weight_update waits for the last load before it closes the
reload.

Loading goes through vLLM's layerwise reload: each layer is rebuilt and re-processed (CPU
prepacking, quantization) once all its tensors arrived, so only a bucket plus the layers
in flight are held, never a second copy of the model. A plain `model.load_weights` fails
on CPU fp32 (prepacked linear weights) after applying half the tensors. The reload does
not re-process a layer that only shares its weight with a reloaded one (a tied LM head):
on CPU that head would keep computing logits from a stale prepacked copy of the old
embedding, so such layers are re-processed at the end.

An adapter update (a LoRA run's, target "adapter") leaves the model alone: its tensors, a few
MiB, are kept as they arrive and hashed alike, then checked against the adapter's config and
written whole into the server's adapter folder (fleetrl/lora.py, $FLEETRL_ADAPTER_DIR) before
the update finishes. vLLM drops its adapters once an update finishes and loads the adapter
again from that folder at the next request that names it.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from fleetrl.contract import WEIGHT_UPDATE_PHASES
from fleetrl.engine.load_pipeline import LoadPipeline
from fleetrl.lora import ADAPTER_DIR_ENV, ADAPTER_NAME, AdapterSpec, check_complete, write_weights
from fleetrl.transports import Receiver, spec
from fleetrl.weights.checksum import WeightsHasher
from fleetrl.weights.wire import InitInfo, UpdateInfo, parse_init, parse_update

BACKEND = "fleetrl"
T = TypeVar("T")
_END = object()  # what `next` gives back once an iterator is spent


class FleetrlWeightReceiver(WeightTransferEngine[InitInfo, UpdateInfo]):
    # No init_info_cls / update_info_cls: they serve only vLLM's default parse_*_info, which
    # this class replaces with the envelope's (one backend, every registered transport).
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receiver: Receiver | None = None  # of the transport the init named
        self._transport = ""  # its name, which reads the update records
        self._adapter_folder: Path | None = None  # set while the init names the adapter as its target
        self._adapter: list[tuple[str, torch.Tensor]] | None = None  # an open adapter update's tensors
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
        self._pipeline: LoadPipeline[list[tuple[str, torch.Tensor]]] | None = None

    # -- protocol ---------------------------------------------------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        return parse_init(init_dict)

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """(Re)joins: a new init replaces the previous group (the worker set changed)."""
        self.shutdown()
        self._adapter_folder = self._adapter_folder_for(init_info.target)
        parallel = self.parallel_config
        self._receiver = spec(init_info.transport).receiver_class().join(
            init_info, parallel.data_parallel_index * parallel.world_size + parallel.rank)
        self._transport = init_info.transport

    def start_weight_update(self) -> None:
        if self._receiver is None:
            raise RuntimeError("fleetrl weight receiver: start_weight_update before init_weight_transfer_engine")
        self._open_phases = dict.fromkeys(WEIGHT_UPDATE_PHASES, 0.0)
        with self._timed("start"):
            clear_shared_kv_storage(self.vllm_config)
            if self._adapter_folder is None:
                initialize_layerwise_reload(self.model)
            else:
                self._adapter = []
        self._hasher = WeightsHasher()
        if self._pipeline is None:
            self._pipeline = LoadPipeline(self._hash, self._load)
        self.checksum = None  # the weights are in flux until finish_weight_update

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        if self._receiver is None:
            raise RuntimeError("fleetrl weight receiver: update_weights before init_weight_transfer_engine")
        return parse_update(self._transport, update_dict)

    def receive_weights(self, update_info: UpdateInfo) -> None:
        if self._hasher is None:
            raise RuntimeError("fleetrl weight receiver: update_weights outside start/finish_weight_update")
        try:
            for batch in self._timed_each("receive", self._receiver.receive(update_info)):
                self._submit(batch)
        except BaseException:
            self._abort()
            raise

    def finish_weight_update(self) -> None:
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
                self._close_reload()
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
        """An update is open: between start_weight_update and its finish (or failure)."""
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

    def _submit(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        with self._timed("wait"):  # for earlier items while the pipeline is full
            self._pipeline.submit(tensors)

    def _hash(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        with self._timed("hash"):
            self._hasher.update_all(tensors)  # on a GPU, each tensor is copied to the host to be hashed

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        with self._timed("load"):
            if self._adapter is None:
                self.model.load_weights(tensors)
            else:
                self._adapter.extend(tensors)

    # -- adapter updates ---------------------------------------------------------------------

    def _adapter_folder_for(self, target: str) -> Path | None:
        if target == "model":
            return None
        folder = os.environ.get(ADAPTER_DIR_ENV)
        if not folder or not self.vllm_config.lora_config:
            raise RuntimeError(
                "fleetrl weight receiver: an adapter update needs a server started with --enable-lora, an adapter "
                f"named {ADAPTER_NAME} in --lora-modules, and ${ADAPTER_DIR_ENV} set to that adapter's folder")
        return Path(folder)

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
            self._close_reload()
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

    def _close_reload(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        for layer in _tied_followers(self.model):
            quant_method = getattr(layer, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(layer)


KV_FOLDER = re.compile(r"[0-9a-f]{32}")


def clear_shared_kv_storage(vllm_config: Any) -> None:
    """Empty the store of vLLM's shared-storage KV connector (`ExampleConnector`, fleetrl's
    prefill -> decode transfer on a CPU), once the weights start to change.

    That connector keys the KV it saved by prompt tokens alone, and both the prefill and the
    decode worker load a hit instead of computing it, so KV computed by old weights would
    silently serve the new version. Every worker clears it, all paused; whichever clears
    last removes anything a drained request saved before the publish.
    """
    kv = vllm_config.kv_transfer_config
    if kv is None or kv.kv_connector != "ExampleConnector":
        return
    path = (kv.kv_connector_extra_config or {}).get("shared_storage_path")
    if not path:  # the connector's default is /tmp itself: never empty that
        raise RuntimeError("ExampleConnector without kv_connector_extra_config.shared_storage_path: "
                           "fleetrl cannot clear its KV store at a weight update")
    for entry in Path(path).glob("*"):
        if entry.is_dir() and KV_FOLDER.fullmatch(entry.name):  # the connector's md5-named folders only
            shutil.rmtree(entry, ignore_errors=True)


def _tied_followers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers whose `weight` is the very Parameter of a layer met earlier (tied weights)."""
    owners: set[int] = set()
    followers = []
    for layer in model.modules():
        weight = dict(layer.named_parameters(recurse=False)).get("weight")
        if weight is None:
            continue
        if id(weight) in owners:
            followers.append(layer)
        owners.add(id(weight))
    return followers
