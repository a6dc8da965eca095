"""The filesystem transport: the trainer writes a version as verified shards on storage every
worker reads. Its wire records, its on-disk format, and the sender and receiver sides; `SPEC`
is what the registry (fleetrl/transports.py) knows it by."""

from fleetrl.transports import TransportSpec
from fleetrl.weights.filesystem.wire import FilesystemInit, ManifestInfo

SPEC = TransportSpec(
    name="filesystem", init=FilesystemInit, update=ManifestInfo,
    sender="fleetrl.weights.filesystem.sender:FilesystemTransport",
    receiver="fleetrl.weights.filesystem.receiver:FilesystemReceiver",
)
