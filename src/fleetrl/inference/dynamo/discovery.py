"""Which Dynamo workers exist: the frontend's RL worker list (`GET /v1/rl/workers`).

Each entry is one worker instance (all of its tensor-parallel ranks) of the namespace and
RL component the frontend watches, with the URL of its system server, where its admin
routes live. Its Dynamo instance id is its fleetrl id: unique per worker process and
stable for as long as the process lives, so a restarted worker is a new worker.
"""

from __future__ import annotations

import httpx

from fleetrl.errors import FleetrlError
from fleetrl.inference.http import answered_within
from fleetrl.inference.types import WorkerInfo, WorkerRole

# dynamo.vllm registers prefill workers under the component "prefill"; aggregated and decode
# workers both use "backend", and an entry does not say which of the two a worker is: in a
# list that has prefill workers, they are decode workers (the frontend then routes through them).
_ROLES = {"prefill": WorkerRole.PREFILL}


async def list_rl_workers(http: httpx.AsyncClient, rl_url: str, frontend_url: str,
                          timeout_s: float) -> list[WorkerInfo]:
    """The workers listed at `rl_url`; their requests go through the frontend at `frontend_url`.
    The whole answer within `timeout_s`: `http` bounds each read only, and a frontend that
    trickles its answer would hold the discovery round (and the fleet's start) without end."""
    url = f"{rl_url}/v1/rl/workers"
    try:
        response = await answered_within(timeout_s, http.get(url))
    except httpx.TransportError as e:
        detail = f": {e}" if isinstance(e, httpx.TimeoutException) and str(e) else ""
        raise FleetrlError(f"Dynamo RL discovery at {url} failed: {type(e).__name__}{detail}") from None
    if response.status_code != 200:
        raise FleetrlError(f"Dynamo RL discovery at {url} failed: HTTP {response.status_code}: "
                           f"{response.text[:300]}")
    # An entry with an `error` is an instance the frontend still finds in discovery but cannot
    # reach (killed, its registration not yet expired: with etcd, until its lease's TTL runs out).
    # It has no system URL, so no admin plane: left out, it counts as gone and the fleet marks
    # it dead; should it answer again, its next entry brings it back to be refitted.
    workers = [parse_worker(entry, url, frontend_url) for entry in response.json().get("workers") or []
               if "error" not in entry]
    if any(w.role == WorkerRole.PREFILL for w in workers):
        for worker in workers:
            if worker.role == WorkerRole.AGGREGATED:
                worker.role = WorkerRole.DECODE
    return workers


def parse_worker(entry: dict, source: str, frontend_url: str) -> WorkerInfo:
    worker_id = str(entry.get("instance_id", ""))
    system_url = entry.get("system_url")
    if not worker_id or not system_url:
        raise FleetrlError(f"Dynamo RL discovery at {source} lists a worker without an instance id "
                           f"or system URL: {entry}")
    return WorkerInfo(
        id=worker_id,
        data_url=frontend_url,
        admin_url=system_url.rstrip("/"),
        role=_ROLES.get(entry.get("component"), WorkerRole.AGGREGATED),
        world_size=int(entry.get("world_size") or 1),
    )
