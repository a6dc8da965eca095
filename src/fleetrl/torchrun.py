"""What a launcher told this process about the trainer group it is one rank of.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
every process it starts (a SLURM script may export the same by hand). When they are set,
`fleetrl rl` is one rank of a group that someone else launched, possibly across nodes, and
starts no trainer rank of its own; when none is set, it starts its ranks itself. A leaf without
torch: `--dry-run` reads it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fleetrl.errors import FleetrlError

# What every rank needs to join the default group (LOCAL_WORLD_SIZE is optional: torchrun sets
# it, a hand-written script may not, and then the ranks are taken to be on one node).
REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchedRank:
    rank: int  # global: rank 0 hosts the control side
    world_size: int
    local_rank: int  # on this node: which device, which of trainer.cpu_cores
    local_world_size: int  # ranks on this node: they share its CPUs


def launched_rank(environ: Mapping[str, str] | None = None) -> LaunchedRank | None:
    """This process's place in a trainer group a launcher started, or None when no launcher
    variable is set. Some set but not all, or one that is not a number, is an error naming them."""
    environ = os.environ if environ is None else environ
    present = [name for name in REQUIRED if name in environ]
    if not present:
        return None
    missing = [name for name in REQUIRED if name not in environ]
    if missing:
        raise FleetrlError(f"torchrun variables {', '.join(missing)} are not set while {', '.join(present)} are: "
                           "start every rank with torchrun (or set them all)")
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        value = environ.get(name, environ["WORLD_SIZE"])  # LOCAL_WORLD_SIZE unset: one node
        try:
            numbers[name] = int(value)
        except ValueError:
            raise FleetrlError(f"torchrun variable {name} = {value!r} is not a number") from None
    rank = LaunchedRank(numbers["RANK"], numbers["WORLD_SIZE"], numbers["LOCAL_RANK"], numbers["LOCAL_WORLD_SIZE"])
    if not 0 <= rank.rank < rank.world_size or not 0 <= rank.local_rank < rank.local_world_size <= rank.world_size:
        raise FleetrlError(f"torchrun variables out of range: RANK {rank.rank}, WORLD_SIZE {rank.world_size}, "
                           f"LOCAL_RANK {rank.local_rank}, LOCAL_WORLD_SIZE {rank.local_world_size}")
    return rank
