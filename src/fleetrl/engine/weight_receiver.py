"""vLLM weight-transfer backend `fleetrl`: receives a policy version inside each worker rank.
The thin vLLM side of engine/weight_update.py, which does the rest (receiver, checksum, load
pipeline, adapter folder, phases) for any engine.

vLLM drives it through its weight-transfer protocol (HTTP routes -> engine core ->
collective_rpc on every rank):

    /init_weight_transfer_engine {"init_info": {"transport": a registered name,
                                                "target": "model"|"adapter", ...}}
    /start_weight_update                     open vLLM's layerwise reload
    /update_weights {"update_info": {...}}   stream tensors into model.load_weights
    /finish_weight_update                    close the reload; keep the checksum

The infos are the wire records the sender builds them from (fleetrl.weights.wire).

Loading goes through vLLM's layerwise reload: each layer is rebuilt and re-processed (CPU
prepacking, quantization) once all its tensors arrived, so only a bucket plus the layers
in flight are held, never a second copy of the model. A plain `model.load_weights` fails
on CPU fp32 (prepacked linear weights) after applying half the tensors. The reload does
not re-process a layer that only shares its weight with a reloaded one (a tied LM head):
on CPU that head would keep computing logits from a stale prepacked copy of the old
embedding, so such layers are re-processed at the end.

An adapter update leaves the model alone (engine/weight_update.py writes the adapter's
folder); vLLM drops its adapters once an update finishes and loads the adapter again from that
folder at the next request that names it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from fleetrl.engine.weight_update import Tensors, WeightUpdates
from fleetrl.weights.wire import InitInfo, UpdateInfo, parse_init

BACKEND = "fleetrl"


class FleetrlWeightReceiver(WeightTransferEngine[InitInfo, UpdateInfo]):
    """vLLM's protocol mapped onto `WeightUpdates` (`self.updates`), and vLLM's side of the
    load (engine/weight_update.EngineSide)."""

    # No init_info_cls / update_info_cls: they serve only vLLM's default parse_*_info, which
    # this class replaces with the envelope's (one backend, every registered transport).
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.updates = WeightUpdates(self)

    # -- vLLM's protocol ----------------------------------------------------------------------

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitInfo:
        return parse_init(init_dict)

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        parallel = self.parallel_config
        self.updates.init(init_info, parallel.data_parallel_index * parallel.world_size + parallel.rank,
                          serves_adapters=bool(self.vllm_config.lora_config))

    def start_weight_update(self) -> None:
        self.updates.start()

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        return self.updates.parse_update(update_dict)

    def receive_weights(self, update_info: UpdateInfo) -> None:
        self.updates.receive(update_info)

    def finish_weight_update(self) -> None:
        self.updates.finish()

    def shutdown(self) -> None:
        self.updates.shutdown()

    # -- the engine's side of the load ----------------------------------------------------------

    def before_update(self) -> None:
        clear_shared_kv_storage(self.vllm_config)

    def open_reload(self) -> None:
        initialize_layerwise_reload(self.model)

    def load(self, tensors: Tensors) -> None:
        self.model.load_weights(tensors)

    def close_reload(self) -> None:
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
