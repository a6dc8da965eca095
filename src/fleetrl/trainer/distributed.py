"""The trainer's process group, from torchrun-style environment variables.

RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are what `torchrun` (or any launcher
that mimics it) sets. Without them the trainer is one process and no group is formed: every
collective in the trainer is skipped when the world is 1, so a laptop run needs no rendezvous.

The default group is the trainer's alone; the trainer -> workers broadcast uses its own
stateless group (`fleetrl.weights.group`), never this one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    device: torch.device


def init(timeout_s: float = 600.0) -> World:
    """Joins the default group (gloo on CPU, NCCL on CUDA) when WORLD_SIZE > 1."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            # Binding the device lets NCCL connect eagerly; gloo takes no device.
            device_id=device if device.type == "cuda" else None,
        )
    return World(rank, world_size, device)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
