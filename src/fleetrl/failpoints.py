"""Named points where a fault test holds fleetrl, so that it can send a real signal there.

A kill at a random moment mostly lands in the long phases and hits the short ones (a
checkpoint being finished, the workers mid-update) by chance: a test of them would pass or
fail by timing. With `FLEETRL_FAILPOINT=POINT:STEP` in its environment, fleetrl stops when it
reaches POINT for step STEP, prints `fleetrl: failpoint POINT:STEP reached`, and waits there
until it is signalled. Without the variable every point is a no-op.

Points: `rollout` (step STEP's samples are in, its batch not yet written), `train` (batch
STEP read, not yet applied), `publish` (version STEP's first bucket sent: the workers are
paused mid-update), `checkpoint` (step STEP's shards written, not yet marked complete).

One point fails instead of waiting, for a test that runs the fleet coordinator in its own
process and arms it there: `probe` (every agreement probe scored at version STEP reads as
failed, while the variable is set: the test unsets it once it has seen the failures it needs).
"""

from __future__ import annotations

import asyncio
import os
import time

ENV = "FLEETRL_FAILPOINT"
POINTS = ("rollout", "train", "publish", "checkpoint", "probe")


def _armed(point: str, step: int) -> bool:
    if point not in POINTS:
        raise ValueError(f"unknown failpoint {point!r}")
    if os.environ.get(ENV) != f"{point}:{step}":
        return False
    print(f"fleetrl: failpoint {point}:{step} reached", flush=True)
    return True


def hold(point: str, step: int) -> None:
    """On a thread: wait here, until a signal ends the process, when the failpoint is armed."""
    while _armed(point, step):
        time.sleep(3600)


async def held(point: str, step: int) -> None:
    """On the control loop: the same without blocking the loop, which must stay free to stop
    what fleetrl started when the signal comes."""
    if _armed(point, step):
        await asyncio.Event().wait()


def tripped(point: str, step: int) -> bool:
    """Whether a point that fails instead of waiting (`probe`) is armed for `step`."""
    return _armed(point, step)
