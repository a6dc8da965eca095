"""The HTTP machinery both providers share: the retrying admin call, the cleanup after a
failed weight transfer, the per-rank checksum check, the readiness wait of a launch, and what
the workers' OpenAI-style API is asked and answers (the served model name, prompt logprobs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpx

from fleetrl import admin_signature
from fleetrl.config import admin_backoff_s
from fleetrl.contract import (ADMIN_TOKEN_ENV, CLAIM_LEASE_HEADER, CLAIM_PATH, CLAIM_RUN_HEADER, DYNAMO_INSTANCE_ROUTE,
                              DYNAMO_REFUSAL, INSTANCE_PATH, STALE_INSTANCE, RankWeights)
from fleetrl.errors import FleetrlError
from fleetrl.inference.provider import ImpostorWorker, WorkerCallError, WorkerHeldByAnotherRun
from fleetrl.processes import ManagedProcess
from fleetrl.progress import progress_bar

# The name every launched worker serves the policy under (attached Dynamo frontends say theirs).
SERVED_MODEL_NAME = "policy"
# Short: the calls that clean up after a failed transfer must not hide the failure for long.
ABANDON_TIMEOUT_S = 10.0
# Seconds between the readiness probes of a launch.
READY_POLL_S = 1.0
# True in the fleet's discovery task, whose rounds refit workers holding the publish fence
# (inference/fleet/lifecycle.py, `Lifecycle._discovery_loop`): each admin call is tried once, so
# a worker that does not answer holds a waiting publish back for one timeout, not for
# admin_retries + 1 of them. It is refitted at a later round instead.
SINGLE_TRY: ContextVar[bool] = ContextVar("fleetrl_admin_single_try", default=False)


async def answered_within(timeout_s: float, request: Awaitable[httpx.Response]) -> httpx.Response:
    """`request`'s response, whole within `timeout_s`, else httpx.ReadTimeout. httpx bounds each
    read only: a worker that trickled its answer a byte at a time once held a publish fence
    for 11.7 s with admin_timeout_s = 1."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request
    except TimeoutError:
        raise httpx.ReadTimeout(f"no whole answer within {timeout_s:g} s") from None


def sign(request: httpx.Request, admin_token: str, instance: str) -> str:
    """Signs `request` with the admin token instead of carrying it (fleetrl/admin_signature.py):
    its method, path and query, the authority it addresses, its body, the claim it carries and
    the server `instance` it is for. Returns the nonce that the answer's proof must be made of."""
    call = admin_signature.SignedCall(request.method, request.url.raw_path.decode("ascii"), _authority(request),
                                      request.read(), instance, request.headers.get(CLAIM_RUN_HEADER, ""),
                                      request.headers.get(CLAIM_LEASE_HEADER, ""))
    value, nonce = admin_signature.authorization(admin_token, call)
    request.headers["Authorization"] = value
    return nonce


def _authority(request: httpx.Request) -> str:
    """host:port as the request names it (its Host header, with the scheme's default port if it
    leaves it out): what the worker sees."""
    return admin_signature.with_port(request.headers.get("host") or request.url.netloc.decode("ascii"),
                                     request.url.scheme)


def unproven(response: httpx.Response, admin_token: str, nonce: str, instance: str = "") -> str | None:
    """Why the answer to a signed call for server `instance`, or to a data request naming
    `nonce` (`instance` "": it names none), does not come from a holder of the admin token at
    the address called, or was changed on its way (the proof covers the answer's very body);
    None if it does."""
    expected = admin_signature.answer_proof(admin_token, nonce, _authority(response.request), instance,
                                            response.content)
    if admin_signature.proves(expected, response.headers.get(admin_signature.PROOF_HEADER)):
        return None
    return _without_proof(response)


def _without_proof(response: httpx.Response) -> str:
    """What an answer that proves nothing was, for the error that names its worker."""
    return (f"it answered (HTTP {response.status_code}: {response.text[:120]!r}) without proof that it holds "
            f"the run's admin token: it is not the server fleetrl started or attached to (another process may "
            f"have taken its port), or the answer was changed on its way")


def _json_object(response: httpx.Response) -> dict:
    """The response's JSON object; {} if it is none."""
    try:
        answer = response.json()
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


async def announced_instance(client: httpx.AsyncClient, url: str, timeout_s: float,
                             body_signed: bool = False) -> tuple[str | None, httpx.Response]:
    """The instance the server at `url` ("" for `client`'s base URL) announces to anyone, and
    its answer: a native server's middleware at contract.INSTANCE_PATH, fleetrl's Dynamo worker
    kind (`body_signed`) in its liveness probe's answer. None if it names none."""
    if body_signed:
        response = await answered_within(timeout_s, client.post(f"{url}/engine/{DYNAMO_INSTANCE_ROUTE}", json={},
                                                                timeout=timeout_s))
        announced = _json_object(response).get(admin_signature.BODY_INSTANCE_FIELD)
    else:
        response = await answered_within(timeout_s, client.get(f"{url}{INSTANCE_PATH}", timeout=timeout_s))
        announced = _json_object(response).get("instance")
    return (announced if isinstance(announced, str) and admin_signature.is_nonce(announced) else None), response


@dataclass(frozen=True)
class RunClaim:
    """The run a client's signed calls claim the worker for, and for how long past each call
    (engine/worker_claim.py; inference.claim_lease_s)."""

    run: str
    lease_s: float


class AdminHttp:
    """The admin endpoint of one worker: every call goes straight to it, has a timeout, and is
    retried (`retries` times, backing off) where that is safe: an idempotent call on any
    transport error, any other call only when the connection was never made. With the run's
    admin token, each call is signed with it for the worker's instance (asked once, and again
    when the worker refuses a call as signed for its instance before a restart), and its answer
    must prove the worker holds the token; with a `claim`, each signed call also holds the
    worker for that run, and a worker another run holds refuses it (WorkerHeldByAnotherRun)."""

    def __init__(self, worker_id: str, base_url: str, timeout_s: float, retries: int,
                 admin_token: str | None = None, claim: RunClaim | None = None, body_signed: bool = False) -> None:
        """`body_signed`: the signature rides in the JSON body, and the proof in the JSON answer
        (fleetrl's Dynamo worker kind, admin_signature.signed_body), not in headers."""
        self.worker_id = worker_id
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.retries = retries
        self._admin_token = admin_token
        self._claim = claim
        self._body_signed = body_signed
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout_s)
        self._instance: str | None = None  # the worker's instance, as it last announced it

    @property
    def instance(self) -> str | None:
        """The instance the worker last announced; None before a signed call asked for it."""
        return self._instance

    async def _instance_of_worker(self, timeout_s: float, again: bool) -> str:
        """The instance the worker announces: asked once, and `again` after a stale refusal."""
        if self._instance is None or again:
            announced, response = await announced_instance(self._http, "", timeout_s, self._body_signed)
            if announced is None:
                raise ImpostorWorker(self.worker_id, "instance", f"it names no instance: {_without_proof(response)}")
            self._instance = announced
        return self._instance

    async def _request(self, method: str, path: str, timeout_s: float, signed: bool = False,
                       **kwargs: Any) -> httpx.Response:
        if not (signed and self._admin_token):
            return await answered_within(timeout_s, self._http.send(
                self._http.build_request(method, path, timeout=timeout_s, **kwargs)))
        signed_request = self._body_signed_request if self._body_signed else self._header_signed_request
        for again in (False, True):
            response = await signed_request(method, path, timeout_s, await self._instance_of_worker(timeout_s, again),
                                            **kwargs)
            if response is not None:
                return response
        raise WorkerCallError(self.worker_id, f"{method} {path}",
                              f"{STALE_INSTANCE}, again after it named its instance anew: does it run several API "
                              "server processes (--api-server-count)? fleetrl's signed calls need one")

    async def _header_signed_request(self, method: str, path: str, timeout_s: float, instance: str,
                                     **kwargs: Any) -> httpx.Response | None:
        """A call signed in its headers for `instance`, its answer proven in the worker's; None
        if the worker refused it as signed for another instance of itself."""
        request = self._http.build_request(method, path, timeout=timeout_s, **kwargs)
        if self._claim is not None:
            request.headers[CLAIM_RUN_HEADER] = self._claim.run
            request.headers[CLAIM_LEASE_HEADER] = f"{self._claim.lease_s:g}"
        nonce = sign(request, self._admin_token, instance)
        response = await answered_within(timeout_s, self._http.send(request))
        if response.status_code == 401:
            return None if _json_object(response).get("error") == STALE_INSTANCE else response
        if why := unproven(response, self._admin_token, nonce, instance):
            raise ImpostorWorker(self.worker_id, f"{method} {path}", why)
        if response.status_code == 409 and (held := _held_by(response)) is not None:
            raise WorkerHeldByAnotherRun(self.worker_id, f"{method} {path}", *held)
        return response

    async def _body_signed_request(self, method: str, path: str, timeout_s: float, instance: str,
                                   json: dict | None = None, **kwargs: Any) -> httpx.Response | None:
        """A call of fleetrl's Dynamo worker kind, whose route handlers see only the JSON body:
        signed there for `instance`, afresh for every try, and its answer proven in the answer
        itself; None if the worker refused it as signed for another instance of itself."""
        body, nonce = admin_signature.signed_body(self._admin_token, path, json or {}, instance)
        response = await answered_within(timeout_s, self._http.send(
            self._http.build_request(method, path, timeout=timeout_s, json=body, **kwargs)))
        answer = _json_object(response)
        message = str(answer.get("message", ""))
        if message == STALE_INSTANCE:
            return None
        if message.startswith(DYNAMO_REFUSAL):
            raise WorkerCallError(self.worker_id, f"{method} {path}",
                                  f"the admin token was refused: set inference.admin_token (or ${ADMIN_TOKEN_ENV}) to the "
                                  "one the worker was started with")
        proof = answer.pop(admin_signature.BODY_PROOF_FIELD, None)
        if not (answer and admin_signature.proves(admin_signature.body_proof(self._admin_token, nonce, instance, answer),
                                                  proof)):
            raise ImpostorWorker(self.worker_id, f"{method} {path}", _without_proof(response))
        return response

    async def close(self) -> None:
        """Let the worker go, if this client's run holds it (best effort: a dead worker holds
        nothing), then close the connections."""
        if self._claim is not None and self._admin_token:
            try:
                await self._request("DELETE", CLAIM_PATH, ABANDON_TIMEOUT_S, signed=True)
            except (httpx.TransportError, WorkerCallError):
                pass
        await self._http.aclose()

    async def probe(self, method: str, path: str, timeout_s: float, signed: bool = False,
                    **kwargs: Any) -> httpx.Response | None:
        """A health probe: one try, never retried; None when the worker cannot be reached.
        Signed (with the admin token), an answer without the worker's proof raises ImpostorWorker."""
        try:
            return await self._request(method, path, timeout_s, signed=signed, **kwargs)
        except httpx.TransportError:
            return None

    async def call(self, method: str, path: str, *, idempotent: bool, timeout_s: float | None = None,
                   what: str | None = None, signed: bool = True, **kwargs: Any) -> httpx.Response:
        """The response of a call that succeeded (HTTP status below 400); WorkerCallError,
        naming the worker and `what` (default: the method and path), otherwise. `signed` False:
        a route that is no admin route (Dynamo's /metrics, which no handler of fleetrl's sees)."""
        what = what or f"{method} {path}"
        retries = 0 if SINGLE_TRY.get() else self.retries
        for attempt in range(retries + 1):
            try:
                response = await self._request(method, path, timeout_s if timeout_s is not None else self.timeout_s,
                                               signed=signed, **kwargs)
            except httpx.ConnectError as e:
                error = f"cannot connect to {self.base_url} ({e})"
            except httpx.TransportError as e:
                if not idempotent:
                    raise WorkerCallError(self.worker_id, what, f"{type(e).__name__}: {e}") from None
                error = f"{type(e).__name__} talking to {self.base_url}"
            else:
                if response.status_code == 401:
                    raise WorkerCallError(self.worker_id, what, f"the admin token was refused ({response.text[:300]})")
                if response.status_code >= 400:
                    raise WorkerCallError(self.worker_id, what, f"HTTP {response.status_code}: {response.text[:300]}")
                return response
            if attempt < retries:
                await asyncio.sleep(admin_backoff_s(attempt))
        raise WorkerCallError(self.worker_id, what, error)


def _held_by(response: httpx.Response) -> tuple[str, float] | None:
    """(the holding run, its lease left) from a worker's refusal of a call by another run."""
    try:
        body = response.json()
        return str(body["held_by"]), float(body["lease_left_s"])
    except (ValueError, KeyError, TypeError):
        return None


async def abandon_weight_update(close_update: Callable[[], Awaitable[object]],
                                label_incomplete: Callable[[], Awaitable[object]]) -> None:
    """After a failed transfer (best effort): close any open update, then label the worker with
    a name that is no policy version, so its half-updated weights pass for none. A step that
    fails is passed over: no update was open (the worker aborted it itself), or the worker is
    gone."""
    for step in (close_update, label_incomplete):
        try:
            await step()
        except FleetrlError:
            pass


# vLLM's Prometheus gauges of the requests an engine holds: running, and queued for it.
IN_ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def requests_in_engine(metrics_text: str) -> int | None:
    """Requests running or waiting in the engine, from its Prometheus text (every sample of
    both gauges summed: one per model and engine); None when neither gauge is there."""
    total = metric_total(metrics_text, IN_ENGINE_GAUGES)
    return None if total is None else round(total)


def metric_total(metrics_text: str, names: Sequence[str]) -> float | None:
    """Every sample of the Prometheus metrics `names` in `metrics_text`, summed; None when none
    of them is there."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def check_rank_checksums(worker_id: str, ranks: list[RankWeights], sender_checksum: str | None) -> None:
    """A worker holds the published weights only if every one of its ranks reports the sender's
    checksum (each computed by the rank from the bytes it received). `sender_checksum` None:
    nothing was published, and no rank may have received anything."""
    held = {rank.checksum for rank in ranks}
    if held != {sender_checksum}:
        expected = "none received (the weights it was launched with)" if sender_checksum is None \
            else f"sender's {sender_checksum}"
        raise WorkerCallError(worker_id, "weight check",
                              f"weight checksum {sorted(map(str, held))} != {expected}")


async def wait_until_ready(what: str, total: int, processes: Sequence[ManagedProcess],
                           not_ready: Callable[[], Awaitable[tuple[int, str] | None]], timeout_s: float,
                           log=print) -> None:
    """Poll `not_ready` (None once ready, else how many of `total` are, and why not all yet)
    until the launch of `what` is ready, with a progress bar (fleetrl.progress).

    Fails at once when one of `processes` exits, with the last lines of its log, and after
    `timeout_s` (inference.startup_timeout_s) with the last reason.
    """
    started = time.monotonic()
    with progress_bar(what, total, log, label=f"starting {what}") as bar:
        while True:
            for process in processes:
                if not process.alive():
                    raise FleetrlError(
                        f"{process.name} exited during startup (code {process.popen.returncode}); "
                        f"last lines of {process.log_path}:\n{process.log_tail()}"
                    )
            state = await not_ready()
            if state is None:
                break
            done, why = state
            if time.monotonic() - started > timeout_s:
                raise FleetrlError(f"{what} not ready after {timeout_s:.0f} s (inference.startup_timeout_s): {why}; "
                                   f"see logs in {processes[0].log_path.parent}")
            bar.update(done, why)
            await asyncio.sleep(READY_POLL_S)
    log(f"fleetrl: {what} ready after {time.monotonic() - started:.0f} s")


def prompt_logprobs_of(token_ids: list[int], scored: list[dict | None]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1 from vLLM's `prompt_logprobs` (one entry per
    prompt token, keyed by token id; the first is None)."""
    return [float(entry[str(token)]["logprob"]) for token, entry in zip(token_ids[1:], scored[1:])]
