"""The trainer's process group, from torchrun-style environment variables.

RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are what `torchrun` (or any launcher
that mimics it) sets, and what `fleetrl rl` sets for the ranks it starts itself (`fleetrl.torchrun`
reads them). Without them the trainer is one process and no group is formed: every collective
in the trainer is skipped when the world is 1, so a laptop run needs no rendezvous.

The default group is the trainer's alone; the trainer -> workers broadcast uses its own
stateless group (`fleetrl.weights.broadcast.group`), never this one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fleetrl.config import Config
from fleetrl.cores import parse_cpus
from fleetrl.torchrun import LaunchedRank, launched_rank

# The longest a train step may take on one rank beyond its peers (their collectives wait for it).
TRAIN_STEP_BOUND_S = 600.0


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    device: torch.device
    local_rank: int = 0  # on this node
    local_world_size: int = 1  # ranks on this node, which share its CPUs


def collective_timeout_s(config: Config) -> float:
    """How long a rank waits in a collective for its peers before it gives up.

    The longest legal wait is rank 0's work between two collectives: the fleet's start (on a
    resumed run, before the first publish), one publish (pause, verify and resume are admin
    calls with retries and their backoff; join, start, update and finish are transfer steps)
    with its evaluations (eval.every_steps), and a train step.
    A shorter timeout would kill a healthy run that publishes slowly; a longer one only delays
    the error when a rank dies, which rank 0 reports by name anyway.
    """
    i, o = config.inference, config.orchestrator
    admin_call_s = i.admin_call_bound_s()
    publish_s = 3 * admin_call_s + 4 * i.weights.transfer_timeout_s
    # An evaluation in the publish hook: its requests run at once, each episode at most
    # max_turns requests and answers; twice that, for a request sent again to another worker.
    eval_s = 2 * o.max_turns * (i.request_timeout_s + o.reward_timeout_s) if config.eval.every_steps else 0
    return i.startup_timeout_s + publish_s + eval_s + TRAIN_STEP_BOUND_S


def init(timeout_s: float, rendezvous: Mapping[str, str] | None = None) -> World:
    """Joins the default group (gloo on CPU, NCCL on CUDA) when WORLD_SIZE > 1: from the
    launcher's variables in this process's environment, or from `rendezvous` (the same
    variables, for rank 0 of the ranks `fleetrl rl` starts itself: os.environ is left alone, so
    the workers it launches meanwhile inherit none of them)."""
    launched = launched_rank(rendezvous) or LaunchedRank(rank=0, world_size=1, local_rank=0, local_world_size=1)
    rank, world_size, local_rank = launched.rank, launched.world_size, launched.local_rank
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
            init_method=f"tcp://{rendezvous['MASTER_ADDR']}:{rendezvous['MASTER_PORT']}" if rendezvous else None,
            # Binding the device lets NCCL connect eagerly; gloo takes no device.
            device_id=device if device.type == "cuda" else None,
        )
    return World(rank, world_size, device, local_rank, launched.local_world_size)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def use_cpus(cpu_cores: list[str], world: World) -> None:
    """Run this rank on its CPUs (trainer.cpu_cores, cycled over the ranks of a node) with one
    torch thread per CPU; without any set, on every CPU of the node, the threads shared out among
    its ranks. Threads made later (torch's pool) inherit the calling thread's CPUs; threads made
    before keep theirs."""
    if cpu_cores:
        cpus = parse_cpus(cpu_cores[world.local_rank % len(cpu_cores)])
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // world.local_world_size))


def broadcast_from_rank0(value: object) -> object:
    """Rank 0's `value` on every rank (any picklable object; the others pass None)."""
    if world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
