"""Weight transfer in torch only (no vLLM): one package per transport with its wire records,
its sender (runs in the trainer) and its receiver (runs in every worker rank, driven by
engine/weight_receiver.py), side by side; and what both sides share: the envelope of the wire
records, the checksum, the bucket layout. `factory.make_transport` builds the transport that
the fleet coordinator drives."""

from fleetrl.weights.checksum import WeightsHasher

__all__ = ["WeightsHasher"]
