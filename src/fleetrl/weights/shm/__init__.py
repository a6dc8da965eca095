"""The shared-memory transport, for workers on the trainer's own host: the trainer writes a
version into one file in the host's shared memory (/dev/shm), and every worker rank reads it
and checks its sha256 before it loads a tensor. No network path and no shared storage; the CPU
path's cheapest transport. Its wire records and its two sides; `SPEC` is what the registry
(fleetrl/transports.py) knows it by."""

from fleetrl.transports import TransportSpec
from fleetrl.weights.shm.wire import ShmInit, ShmVersion

SPEC = TransportSpec(
    name="shm", init=ShmInit, update=ShmVersion,
    sender="fleetrl.weights.shm.sender:ShmTransport",
    receiver="fleetrl.weights.shm.receiver:ShmReceiver",
)
