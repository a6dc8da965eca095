"""The broadcast transport: the trainer is rank 0 of a group with every worker rank and sends
the weights bucket by bucket. Its wire records, its group, and the sender and receiver sides;
`SPEC` is what the registry (fleetrl/transports.py) knows it by."""

from fleetrl.transports import TransportSpec
from fleetrl.weights.broadcast.wire import BroadcastInit, BucketInfo

SPEC = TransportSpec(
    name="broadcast", init=BroadcastInit, update=BucketInfo,
    sender="fleetrl.weights.broadcast.sender:BroadcastTransport",
    receiver="fleetrl.weights.broadcast.receiver:BroadcastReceiver",
)
