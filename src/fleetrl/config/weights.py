"""`[inference.weights]`: how each new policy version travels from the trainer to every worker
(the transport, its bucket size, backend, storage and time limit)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from fleetrl.config.section import MAX_WAIT_S, Section
from fleetrl.transports import TRANSPORTS


class WeightsConfig(Section):
    """How each new policy version travels from the trainer to every worker."""

    transport: str = Field(
        "broadcast",
        description="How weights reach workers: a transport of the registry (fleetrl/transports.py): "
        "broadcast (torch.distributed, gloo/NCCL), filesystem (safetensors shards on shared storage) or shm "
        "(one file in this host's shared memory, for workers on the trainer's host only).",
    )
    bucket_mb: int = Field(
        128, ge=1, description="Broadcast bucket size, filesystem shard size, or what shm packs at once, in MiB."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="torch.distributed backend of the broadcast: auto = NCCL, GPU to GPU, when the "
        "weights sent are on CUDA (a CUDA trainer), gloo over TCP otherwise (a CPU trainer); gloo on a "
        "CUDA trainer stages each bucket through host memory (for workers NCCL cannot reach); nccl "
        "needs a CUDA device in the trainer.",
    )
    dir: Path | None = Field(
        None,
        description="Filesystem transport's storage, readable by every worker; unset = RUN_DIR/weights.",
    )
    sender_host: str = Field(
        "127.0.0.1", description="Address at which workers reach the trainer's broadcast group."
    )
    transfer_timeout_s: float = Field(
        600.0, gt=0, le=MAX_WAIT_S, description="Limit for each weight-transfer step on a worker (join, bucket, load)."
    )

    @field_validator("transport")
    @classmethod
    def _registered(cls, transport: str) -> str:
        if transport not in TRANSPORTS:
            raise ValueError(f"{transport!r} is not one of {', '.join(TRANSPORTS)}")
        return transport
