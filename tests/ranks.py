"""Real trainer ranks for the tests: `world` spawned processes joined in one gloo group on
loopback, each running `target(rank, *args)`. A rank that fails writes its traceback to
OUT_DIR/rank<r>.err, which the failing assertion shows."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

from fleetrl.trainer import distributed


def spawn_ranks(target: Callable, world: int, out_dir: Path, *args, timeout_s: float = 240) -> None:
    """Runs `target(rank, *args)` on ranks 0..world-1 (each with the default group joined and
    one torch thread) and waits for all; fails naming what went wrong on any."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    ranks = [ctx.Process(target=_rank, args=(target, r, world, port, out_dir, args)) for r in range(world)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(timeout=timeout_s)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join()
    errors = "\n".join(e.read_text() for e in sorted(Path(out_dir).glob("rank*.err")))
    assert all(p.exitcode == 0 for p in ranks), errors or f"exit codes {[p.exitcode for p in ranks]}"


def _rank(target: Callable, rank: int, world: int, port: int, out_dir: Path, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # several ranks on a shared two-core machine
    try:
        distributed.init(timeout_s=120)
        target(rank, *args)
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        distributed.destroy()
    # The work is done and saved. Leave without the interpreter's finalization, where a gloo
    # thread now and then aborts the process ("terminate called without an active exception",
    # no Python frame on any thread; about 1 run in 50 here) and the exit code would then
    # blame work that succeeded.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
