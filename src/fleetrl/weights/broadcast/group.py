"""The trainer -> workers broadcast group: rank 0 is the sender, ranks 1.. are the workers'
ranks.

It is *stateless*: its own TCPStore and a bare ProcessGroupGloo / ProcessGroupNCCL, never
torch.distributed's default group. Every vLLM worker already has a default group (its
tensor-parallel world), and a trainer with several ranks has its own; this group must not
touch either, and must be re-formed whenever the set of workers changes.
"""

from __future__ import annotations

import ipaddress
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from fleetrl.errors import FleetrlError

Backend = Literal["gloo", "nccl"]
BackendSetting = Literal["auto", "gloo", "nccl"]  # `inference.weights.backend`
_ARRIVED = "arrived"


def backend_for(device: torch.device) -> Backend:
    """NCCL moves CUDA tensors GPU to GPU; gloo moves CPU tensors over TCP."""
    return "nccl" if device.type == "cuda" else "gloo"


def choose_backend(setting: BackendSetting, device: torch.device) -> Backend:
    """The group's backend: `auto` follows where the sender's tensors live (`backend_for`);
    `gloo` or `nccl` is the user's override. gloo with CUDA tensors stages each bucket through
    host memory (for workers NCCL cannot reach); nccl with CPU tensors stages each bucket
    through this process's GPU."""
    require_backend(setting)
    return backend_for(device) if setting == "auto" else setting


def require_backend(setting: BackendSetting) -> None:
    """Refuses a backend this process cannot run, before any worker is asked to join."""
    if setting not in ("auto", "gloo", "nccl"):
        raise ValueError(f"broadcast backend {setting!r} is not one of auto, gloo, nccl")
    if setting == "nccl" and not torch.cuda.is_available():
        raise FleetrlError("inference.weights.backend = nccl needs a CUDA device in the trainer, and it "
                           "has none: use auto (gloo on a CPU trainer) or gloo")


class BroadcastGroup:
    def __init__(self, name: str, rank: int, world_size: int, backend_name: Backend,
                 store: dist.TCPStore, backend) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend_name = backend_name
        self._store = store  # the rendezvous store must outlive the group
        self._backend = backend  # a ProcessGroupGloo or ProcessGroupNCCL

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0 sends `tensor`; every other rank receives into its `tensor` (same size)."""
        if self._backend is None:
            raise RuntimeError(f"broadcast group {self.name} is closed")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self._backend.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            # The NCCL work only orders the current stream; the caller may read or free the
            # buffer as soon as we return.
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        """Leaves the group. Dropping the backend is what closes gloo's connections, so
        peers blocked in a broadcast fail at once ("connection closed by peer") instead of
        waiting out the timeout."""
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.abort()
            except RuntimeError:
                pass  # a peer may be gone already; that is often why we close


def open_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The sender's rendezvous store, on a free port of `host` (read it back from `.port`)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def join(store: dist.TCPStore, name: str, rank: int, world_size: int, backend_name: Backend,
         timeout_s: float) -> BroadcastGroup:
    """Blocks until all `world_size` ranks have joined group `name` on `store`.

    Every rank passes the sender's `backend_name` (the sender picks it from where its
    tensors live); with NCCL each rank must have set its current CUDA device.
    """
    # The prefix keeps keys of successive groups on one store apart.
    prefixed = dist.PrefixStore(f"fleetrl/{name}/", store)
    if rank > 0:
        prefixed.add(_ARRIVED, 1)
    timeout = timedelta(seconds=timeout_s)
    if backend_name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [_gloo_device(store.host)]
        backend = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    group = BroadcastGroup(name, rank, world_size, backend_name, store, backend)
    # NCCL connects lazily; a first tiny broadcast makes join() return only once every rank
    # is really connected, so a bad address fails here, not in the middle of a publish.
    group.broadcast(torch.zeros(1, dtype=torch.uint8, device=buffer_device(backend_name)))
    return group


def arrived(store: dist.TCPStore, name: str) -> int:
    """How many non-sender ranks have started to join group `name`. The sender waits for all
    of them (in a loop it can abandon) before its own, uninterruptible, join."""
    return dist.PrefixStore(f"fleetrl/{name}/", store).add(_ARRIVED, 0)


def buffer_device(backend_name: Backend) -> torch.device:
    """Where a rank's broadcast buffers live: the current GPU for NCCL, else the CPU."""
    if backend_name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gloo_device(sender_host: str):
    """On one machine (a loopback sender) everyone talks over loopback; otherwise gloo
    picks the interface the hostname resolves to (GLOO_SOCKET_IFNAME overrides it)."""
    try:
        loopback = ipaddress.ip_address(sender_host).is_loopback
    except ValueError:
        loopback = sender_host == "localhost"
    if loopback:
        return dist.ProcessGroupGloo.create_device(hostname=sender_host)
    return dist.ProcessGroupGloo.create_default_device()
