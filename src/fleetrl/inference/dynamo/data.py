"""Data plane through the Dynamo frontend: token ids in, token ids + logprobs out.

`POST /v1/completions` with the prompt as token ids, `x-worker-instance-id` pinning the
request to the worker the coordinator chose, and `nvext.extra_fields` asking for the
completion's token ids and the worker that served it. Dynamo refuses `completion_token_ids`
for more than one choice, so a request for n samples is sent as n requests (seed + i when
the request is seeded).

Versions: what is asked for and read is the worker kind's (worker_kinds.py): fleetrl's returns
vLLM's per-token spans, Dynamo's own leaves them to the provider (attribution.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from fleetrl.errors import FleetrlError
from fleetrl.inference import answers
from fleetrl.inference.answers import Choice
from fleetrl.inference.dynamo.worker_kinds import DynamoWorkerKind
from fleetrl.inference.http import answered_within, prompt_logprobs_of
from fleetrl.inference.types import GenerateRequest, GenerateResponse

EXTRA_FIELDS = ["completion_token_ids", "worker_id"]


class DynamoDataClient:
    def __init__(self, frontend_url: str, model_name: str, timeout_s: float, run: str | None,
                 max_connections: int = 256, vocab_size: int | None = None) -> None:
        self.frontend_url = frontend_url
        # Every token's label must name a version of this run; None: a client that asks for no
        # per-token versions (the launch's readiness check).
        self.run = run
        self.vocab_size = vocab_size  # every token id must be below it (answers.vocab_size); None: not known
        self.model_name = model_name
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=frontend_url,
            timeout=timeout_s,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "DynamoDataClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def complete(self, worker_id: str, prefill_id: str | None, request: GenerateRequest,
                       prompt_suffix: list[int], sample: int, kind: DynamoWorkerKind) -> GenerateResponse:
        """Sample `sample` of `request` on worker `worker_id`, prefilled by `prefill_id` if set,
        with the versions its worker `kind` gives (fleetrl's: the engine's spans; Dynamo's own:
        none, left to the caller)."""
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": list(request.prompt_token_ids) + list(prompt_suffix),
            "max_tokens": s.max_tokens - len(prompt_suffix),
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stop_token_ids": list(s.stop_token_ids),
            "ignore_eos": s.ignore_eos,
            "nvext": {"extra_fields": EXTRA_FIELDS + list(kind.extra_fields)},
        }
        if s.logprobs:
            body["logprobs"] = 0
        if s.seed is not None:
            body["seed"] = s.seed + sample
        choices, nvext = await self._post(worker_id, body, f"generate {request.request_id}", prefill_id)
        engine = nvext.get("engine_data") or {}
        kind.check_engine_data(engine, worker_id, request.request_id, self.run)

        def read(choice: dict) -> Choice:
            return Choice(token_ids=nvext.get("completion_token_ids") or [],
                          logprobs=(choice.get("logprobs") or {}).get("token_logprobs") or [],
                          # none: a bad sample, never read as "abort"
                          finish_reason=kind.finish_reason(choice.get("finish_reason"), engine),
                          weight_versions=kind.weight_versions(engine))

        # One sample per request (Dynamo refuses completion_token_ids for more than one choice).
        (response,) = answers.samples(worker_id, request, choices, 1, self.run, self.vocab_size, read,
                                      body["max_tokens"])
        # Whoever prefilled is accounted for, pinned or not (a deployment whose prefill
        # workers fleetrl does not see): the provider checks that worker's version.
        prefilled_by = (nvext.get("worker_id") or {}).get("prefill_worker_id")
        if prefilled_by is not None and str(prefilled_by) != worker_id and response.answer_error is None:
            response.prefill_worker_id = str(prefilled_by)
        return response

    async def prompt_logprobs(self, worker_id: str, token_ids: list[int], prefill_id: str | None = None) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1, scored by the worker's current weights."""
        body = {
            "model": self.model_name,
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "nvext": {"extra_fields": ["engine_data", "worker_id"]},
        }
        _, nvext = await self._post(worker_id, body, "scoring", prefill_id)
        scored = (nvext.get("engine_data") or {}).get("prompt_logprobs")
        if not scored or len(scored) != len(token_ids):
            raise FleetrlError(f"worker {worker_id}: scoring returned no prompt logprobs for {len(token_ids)} tokens")
        return prompt_logprobs_of(token_ids, scored)

    async def _post(self, worker_id: str, body: dict, what: str, prefill_id: str | None = None) -> tuple[object, dict]:
        """The answer's choices (unchecked) and its nvext."""
        url = f"{self.frontend_url}/v1/completions"
        headers = {"x-worker-instance-id": worker_id}
        if prefill_id is not None:
            headers["x-prefill-instance-id"] = prefill_id
        try:
            response = await answered_within(self.timeout_s, self._http.post("/v1/completions", json=body,
                                                                              headers=headers))
        except httpx.TransportError as e:
            raise FleetrlError(f"worker {worker_id}: {what} failed: {type(e).__name__} talking to {url}") from None
        if response.status_code != 200:
            raise FleetrlError(f"worker {worker_id}: {what} failed: HTTP {response.status_code} from {url}: "
                               f"{response.text[:300]}")
        result = response.json()
        nvext = result.get("nvext") or {}
        served = nvext.get("worker_id") or {}
        # The versions attributed to the work are the pinned workers': anything else is a lie.
        if str(served.get("decode_worker_id")) != worker_id:
            raise FleetrlError(f"worker {worker_id}: {what} was served by worker {served.get('decode_worker_id')} "
                               f"despite x-worker-instance-id ({url})")
        prefilled_by = served.get("prefill_worker_id")
        if prefill_id is not None and str(prefilled_by) != prefill_id:
            raise FleetrlError(f"worker {worker_id}: {what} was prefilled by worker {prefilled_by}, not by "
                               f"{prefill_id} as x-prefill-instance-id asked ({url})")
        return result["choices"], nvext


async def gather_samples(data: DynamoDataClient, worker_id: str, prefill_id: str | None, request: GenerateRequest,
                         prompt_suffix: list[int], kind: DynamoWorkerKind) -> list[GenerateResponse]:
    return list(await asyncio.gather(*(data.complete(worker_id, prefill_id, request, prompt_suffix, i, kind)
                                       for i in range(request.n))))


async def served_model(client: httpx.AsyncClient, frontend_url: str) -> str:
    """The one model an attached frontend serves (the policy fleetrl trains)."""
    try:
        response = await client.get(f"{frontend_url}/v1/models")
    except httpx.TransportError as e:
        raise FleetrlError(f"Dynamo frontend at {frontend_url}: GET /v1/models failed: {type(e).__name__}") from None
    names = [m["id"] for m in response.json().get("data") or []] if response.status_code == 200 else []
    if len(names) != 1:
        raise FleetrlError(f"Dynamo frontend at {frontend_url} serves {len(names)} models {names}; fleetrl "
                           "attaches to a deployment that serves exactly one (the policy)")
    return names[0]
