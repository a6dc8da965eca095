"""How both transports call the workers of a transfer: all at once, failures named.

The caller has paused the workers; a transfer between start and finish of an update must
never overlap with serving (it kills a vLLM engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fleetrl.errors import FleetrlError
from fleetrl.inference.provider import WeightSyncClient

T = TypeVar("T")


class WeightTransferError(FleetrlError):
    pass


async def on_all(workers: Sequence[WeightSyncClient], call: Callable[[WeightSyncClient], Awaitable[T]]) -> list[T]:
    """`call` on every worker concurrently; waits for all, then raises the first failure."""
    results = await asyncio.gather(*(call(w) for w in workers), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


async def run_together(*steps: Awaitable[Any], on_failure: Callable[[], None]) -> None:
    """Runs steps that rendezvous with each other (HTTP calls that block in a collective,
    and the sender's side of it in a thread). At the first failure `on_failure` runs — it
    breaks the collective so the others fail fast instead of waiting out its timeout —
    then every step is awaited and the failure of the earliest step raised (pass the
    worker calls first: their errors name the worker and say what went wrong)."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    if any(t.exception() is not None for t in done):
        on_failure()
        await asyncio.wait(tasks)
        errors = [t.exception() for t in tasks]  # retrieves every error, not just the raised one
        raise next(e for e in errors if e is not None)


async def abandon_update(workers: Sequence[WeightSyncClient], version: int) -> None:
    await asyncio.gather(*(w.abandon(version) for w in workers))


async def update_in_phases(workers: Sequence[WeightSyncClient], init_info: dict, update_info: dict, version: int,
                           timeout_s: float) -> None:
    """A whole version already written where every worker reads it (a file, a folder): init,
    start, update and finish on every worker, each phase on all before the next, the update
    abandoned on every worker if any phase fails."""
    try:
        # Cheap (no group to join), so done every time: a restarted worker needs it too.
        await on_all(workers, lambda w: w.init(init_info, timeout_s))
        await on_all(workers, lambda w: w.start(timeout_s))
        await on_all(workers, lambda w: w.update(update_info, timeout_s))
        await on_all(workers, lambda w: w.finish(version, timeout_s))
    except BaseException:
        await abandon_update(workers, version)
        raise
