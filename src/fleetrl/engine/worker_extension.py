"""fleetrl's mixin for vLLM worker classes (`--worker-extension-cls
fleetrl.engine.worker_extension.FleetrlWorkerExtension`).

vLLM imports this module in every worker process before it builds the worker's
weight-transfer engine, so importing it is what registers the `fleetrl` backend
(`--weight-transfer-config '{"backend": "fleetrl"}'`), and puts fleetrl's per-adapter
products in place of vLLM's CPU LoRA ops (engine/cpu_lora.py). The methods below are reachable
through `/collective_rpc`, which returns one result per rank, or through a Dynamo worker's
`engine_rpc` routes, which return none: fleetrl's Dynamo worker entry returns the checksum
method's results itself (engine/dynamo_worker.py), and `fleetrl_verify_broadcast_group`
raises instead. Every name starts with `fleetrl_`: vLLM refuses an extension whose attribute
names clash with the worker's.
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from fleetrl.contract import RankWeights
from fleetrl.engine.cpu_lora import use_per_adapter_products
from fleetrl.engine.weight_receiver import BACKEND, FleetrlWeightReceiver
from fleetrl.engine.weight_update import WeightUpdates


def _register_backend() -> None:
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, FleetrlWeightReceiver)
    except ValueError:
        # Already registered: this module was imported a second time in this process.
        pass


_register_backend()
use_per_adapter_products()


class FleetrlWorkerExtension:
    def _fleetrl_receiver(self) -> WeightUpdates | None:
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.updates if isinstance(engine, FleetrlWeightReceiver) else None

    def fleetrl_weight_state(self) -> dict:
        """What this rank holds (contract.RankWeights, as JSON): the fleetrl checksum of the
        weights it last received in full, computed by its receiver from the bytes it got (None
        if none), when that update finished, how many tensor bytes it got, whether one is open,
        and the seconds that update spent in each receiver phase. Named in
        contract.WEIGHT_STATE_METHOD."""
        receiver = self._fleetrl_receiver()
        if receiver is None:
            return RankWeights(checksum=None).to_dict()
        return RankWeights(checksum=receiver.checksum, received_at=receiver.received_at,
                           received_bytes=receiver.received_bytes, updating=receiver.updating,
                           phases=receiver.phases).to_dict()

    def fleetrl_broadcast_group(self) -> str:
        """Name of the broadcast group this rank has joined; "" if none. The sender re-forms
        the group when any rank of any worker is not in its current one (a restarted worker)."""
        receiver = self._fleetrl_receiver()
        return receiver.group_name if receiver else ""

    def fleetrl_verify_broadcast_group(self, group_name: str) -> None:
        joined = self.fleetrl_broadcast_group()
        if not group_name or joined != group_name:
            raise RuntimeError(f"rank {self.rank}: in broadcast group {joined!r}, not {group_name!r}")
