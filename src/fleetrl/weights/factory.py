"""The weight transport the run asked for (`inference.weights.transport`), built for the fleet
coordinator, which drives it through the provider seam's `WeightTransport` protocol.

A transport moves a policy version onto workers through each worker's weight-sync client,
which maps its calls onto the worker kind's routes (vLLM's weight-transfer protocol, or
Dynamo's RL routes naming the same engine methods), and fleetrl's `fleetrl` weight-transfer
backend receives them in every rank (engine/weight_receiver.py, with the transport's
receiver). Which sender a name builds is the registry's (fleetrl/transports.py).
"""

from __future__ import annotations

from pathlib import Path

from fleetrl.inference.provider import WeightTransport
from fleetrl.transports import SenderSettings, spec


def make_transport(kind: str, *, host: str, bucket_bytes: int, storage_dir: Path,
                   timeout_s: float = 600.0, backend: str = "auto", target: str = "model") -> WeightTransport:
    """`kind`: a name of the registry. The settings are `SenderSettings`' (each transport uses
    what it needs)."""
    settings = SenderSettings(host=host, bucket_bytes=bucket_bytes, storage_dir=storage_dir,
                              timeout_s=timeout_s, backend=backend, target=target)
    return spec(kind).sender_class().from_settings(settings)
