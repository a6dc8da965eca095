"""The publishing side of weight transfer (runs in the trainer; needs no vLLM), and the
formats both sides share: the wire schema, the checksum, the bucket layout, the on-disk
manifest and the broadcast group. `factory.make_transport` builds the transport that the
fleet coordinator drives."""

from fleetrl.weights.checksum import WeightsHasher

__all__ = ["WeightsHasher"]
