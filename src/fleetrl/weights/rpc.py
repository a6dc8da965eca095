"""The weight-transfer HTTP calls on workers, shared by both transports.

Each goes to every worker at once; a failure names the worker. The caller has paused the
workers; a transfer between /start_weight_update and /finish_weight_update must never
overlap with serving (it kills the engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fleetrl.errors import FleetrlError
from fleetrl.inference.types import version_name

if TYPE_CHECKING:
    from fleetrl.inference.vllm.admin import VllmAdminClient

T = TypeVar("T")
# Short: the calls that clean up after a failure must not hide the failure for long.
ABANDON_TIMEOUT_S = 10.0


class WeightTransferError(FleetrlError):
    pass


async def on_all(workers: Sequence[VllmAdminClient], call: Callable[[VllmAdminClient], Awaitable[T]]) -> list[T]:
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


async def start_update(workers: Sequence[VllmAdminClient], timeout_s: float) -> None:
    await on_all(workers, lambda w: w.call("POST", "/start_weight_update", idempotent=False,
                                           timeout_s=timeout_s))


async def update(worker: VllmAdminClient, update_info: dict, timeout_s: float) -> None:
    await worker.call("POST", "/update_weights", idempotent=False, timeout_s=timeout_s,
                      json={"update_info": update_info})


async def finish_update(workers: Sequence[VllmAdminClient], version: int, timeout_s: float) -> None:
    await on_all(workers, lambda w: w.call("POST", "/finish_weight_update", idempotent=False,
                                           timeout_s=timeout_s,
                                           json={"weight_version": version_name(version)}))


async def abandon_update(workers: Sequence[VllmAdminClient], version: int) -> None:
    """After a failed transfer: close any update still open on a worker, and label it with a
    version that names no policy, so nothing mistakes its half-updated weights for the
    previous version. Best effort: the transfer's own error is what the caller reports."""
    async def abandon(worker: VllmAdminClient) -> None:
        # Both calls may be retried: a repeated finish is refused, never applied twice. They
        # need it: vLLM drops the connection after a failed weight call, and the next request
        # on it can fail before reaching the server.
        try:
            await worker.call("POST", "/finish_weight_update", idempotent=True, timeout_s=ABANDON_TIMEOUT_S)
        except FleetrlError:
            pass  # no update open (the worker aborted it itself) or the worker is gone
        try:
            await worker.call("POST", "/update_weight_version", idempotent=True, timeout_s=ABANDON_TIMEOUT_S,
                              json={"new_version": f"incomplete-{version_name(version)}"})
        except FleetrlError:
            pass

    await asyncio.gather(*(abandon(w) for w in workers))
