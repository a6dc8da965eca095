"""The publishing side of weight transfer (runs in the trainer; needs no vLLM), and the
formats both sides share: the checksum, the bucket layout, the on-disk manifest and the
broadcast group. `transport.make_transport` is the entry point of the fleet coordinator."""

from fleetrl.weights.checksum import WeightsHasher

__all__ = ["WeightsHasher"]
