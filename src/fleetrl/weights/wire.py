"""The envelope of a weight transfer's wire records: what a transport's sender posts to each
worker, and what fleetrl's weight receiver reads in every rank of it
(engine/weight_receiver.py). Both sides build and read the records of each transport's
wire.py; neither spells a key by hand.

They travel as JSON objects through vLLM's weight-transfer protocol (native servers) or
Dynamo's RL routes:

    init_info    /init_weight_transfer_engine: {"transport": name, ...the transport's init record}
    update_info  /update_weights, read as the update record of the transport the init named

Each transport's spec names its two records (fleetrl/transports.py), strict records read as the
run's records are (fleetrl/strict.py): a key missing or unknown, or a value of another type, is
refused with the record it belongs to named. No vLLM here: the sender runs in the trainer,
which has none.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from fleetrl.transports import check_name, spec


class InitInfo(Protocol):
    """Every transport's init record: the transport it names, and what its updates replace."""

    transport: ClassVar[str]
    target: str

    def to_dict(self) -> dict[str, Any]: ...


class UpdateInfo(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


def parse_init(data: dict[str, Any]) -> InitInfo:
    """The init record of the transport `data["transport"]` names."""
    transport = data.get("transport")
    check_name(transport, "init_info.transport")
    fields = {key: value for key, value in data.items() if key != "transport"}
    return spec(transport).init.read(fields, "init_info")


def parse_update(transport: str, data: dict[str, Any]) -> UpdateInfo:
    """An update record of `transport`, the one the worker was initialised for."""
    return spec(transport).update.read(data, f"update_info for the fleetrl {transport} transport")
