"""Which fleetrl run holds this worker: a claim with a lease, kept by the worker's admin
middleware (engine/admin_auth.py).

Two runs that reach one worker (both attached to its URL) would each publish into it and
each train on the other's weights as its own. Every signed admin call of a run names the run
(contract.CLAIM_RUN_HEADER) and how long its claim lasts past the call (contract.CLAIM_LEASE_HEADER): the first run to
call holds the worker, each of its calls renews the claim, and a call of any other run is
refused, naming the holder, until the holder releases the worker (when its fleet stops) or its
lease runs out (a run killed without stopping). A call in progress holds the claim however long
it takes. Calls that name no run (an operator's curl, `fleetrl status`) only look.

A Dynamo worker (engine/dynamo_worker.py) keeps one such claim for all of its RL routes, which
see only the JSON body: there the claim rides in the body (contract.DYNAMO_CLAIM_FIELD).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fleetrl.versions import is_run_id

# The longest lease a call may ask for: a claim outlives its run by this much at most.
MAX_LEASE_S = 7 * 86400.0


def parse_claim(run: object, lease_s: object) -> tuple[str, float] | None:
    """The claim a call names (the run, its lease in seconds, within [0, MAX_LEASE_S]); None
    for a call that names no run, or no valid one: it only looks."""
    if not (isinstance(run, str) and is_run_id(run)):
        return None
    try:
        return run, min(max(float(lease_s or 0), 0.0), MAX_LEASE_S)
    except (TypeError, ValueError):
        return None


class WorkerClaim:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.run: str | None = None  # the holder, while its claim is live
        self._until = 0.0  # the claim lapses then, unless a call of the holder is in progress
        self._calls = 0  # the holder's calls in progress

    def holder(self) -> str | None:
        """The run holding the worker now; None when it is free."""
        if self.run is not None and self._calls == 0 and self._clock() >= self._until:
            self.run = None
        return self.run

    def lease_left_s(self) -> float:
        return max(0.0, self._until - self._clock())

    def refusal(self, holder: str) -> dict:
        """The answer to a call of another run than `holder`: the coordinator reads `held_by`
        and `lease_left_s` (inference WorkerHeldByAnotherRun)."""
        return {"error": f"fleetrl: this worker is held by run {holder} (its claim lapses "
                         f"{self.lease_left_s():.0f} s after that run's last call)",
                "held_by": holder, "lease_left_s": self.lease_left_s()}

    def begin(self, run: str, lease_s: float) -> str | None:
        """A call of `run` begins: None when the worker is (now) `run`'s, else the run that holds it."""
        holder = self.holder()
        if holder is not None and holder != run:
            return holder
        if holder is None:
            self.run, self._calls = run, 0
        self._calls += 1
        self._until = max(self._until, self._clock() + lease_s)
        return None

    def end(self, run: str, lease_s: float) -> None:
        """A call that `begin` let in has ended: the lease runs from now."""
        if self.run == run:
            self._calls = max(0, self._calls - 1)
            self._until = max(self._until, self._clock() + lease_s)

    def release(self, run: str) -> None:
        """The holder lets the worker go (its fleet stopped)."""
        if self.run == run:
            self.run, self._until, self._calls = None, 0.0, 0
