"""The envelope of a weight transfer's wire records: what the sender (broadcast/sender.py,
filesystem/sender.py) posts to each worker, and what fleetrl's weight receiver reads in every
rank of it (engine/weight_receiver.py). Both sides build and read the records of each
transport's wire.py; neither spells a key by hand.

They travel as JSON objects through vLLM's weight-transfer protocol (native servers) or
Dynamo's RL routes:

    init_info    /init_weight_transfer_engine: {"transport": kind, ...the kind's init record}
                 BroadcastInit (broadcast/wire.py), FilesystemInit (filesystem/wire.py)
    update_info  /update_weights, read as the kind the init named:
                 BucketInfo (broadcast: the tensors of one bucket),
                 ManifestInfo (filesystem: a whole published version)

Read strictly: a key missing or unknown is refused with the record it belongs to named.
No vLLM here: the sender runs in the trainer, which has none.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from fleetrl.weights.broadcast.wire import BroadcastInit, BucketInfo
from fleetrl.weights.filesystem.wire import FilesystemInit, ManifestInfo

TransportKind = Literal["broadcast", "filesystem"]
TRANSPORTS = get_args(TransportKind)
InitInfo = BroadcastInit | FilesystemInit
UpdateInfo = BucketInfo | ManifestInfo

_INIT: dict[str, type[InitInfo]] = {"broadcast": BroadcastInit, "filesystem": FilesystemInit}
_UPDATE: dict[str, type[UpdateInfo]] = {"broadcast": BucketInfo, "filesystem": ManifestInfo}


def parse_init(data: dict[str, Any]) -> InitInfo:
    """The init record of the transport `data["transport"]` names."""
    transport = data.get("transport")
    if transport not in TRANSPORTS:
        raise ValueError(f"init_info.transport: {transport!r} is not one of {TRANSPORTS}")
    fields = {key: value for key, value in data.items() if key != "transport"}
    return _read(_INIT[transport], fields, "init_info")


def parse_update(transport: TransportKind, data: dict[str, Any]) -> UpdateInfo:
    """An update record of `transport`, the one the worker was initialised for."""
    return _read(_UPDATE[transport], data, f"update_info for the fleetrl {transport} transport")


def _read(cls, data: dict[str, Any], what: str):
    try:
        return cls(**data)
    except TypeError as e:  # a missing or an unknown key
        raise ValueError(f"{what}: {e}") from None
