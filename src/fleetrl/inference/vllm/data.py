"""Data plane of native vLLM workers: token ids in, token ids + logprobs + version spans out.

Uses vLLM's `/inference/v1/generate` (enabled by `--enable-scale-out`), whose choices carry
`weight_versions`: the engine's own record of which weight version produced which tokens.
fleetrl checks that record, it never reconstructs it. Requests carry the run's data token,
which opens sampling and nothing else (engine/admin_auth.py).
"""

from __future__ import annotations

from typing import Any

import httpx

from fleetrl import admin_signature
from fleetrl.errors import FleetrlError
from fleetrl.inference import answers
from fleetrl.inference.answers import Choice
from fleetrl.inference.http import SERVED_MODEL_NAME, answered_within, prompt_logprobs_of, unproven
from fleetrl.inference.provider import ImpostorWorker
from fleetrl.inference.types import GenerateRequest, GenerateResponse


class VllmDataClient:
    def __init__(self, data_token: str | None, timeout_s: float, run: str | None, max_connections: int = 256,
                 admin_token: str | None = None, model: str = SERVED_MODEL_NAME, vocab_size: int | None = None) -> None:
        # No token: a coordinator that only reads the workers' state (`fleetrl status`). With
        # the admin token, every answer must carry the worker's proof of a nonce of this client's
        # (admin_signature.py): a process on a dead worker's port cannot answer for it.
        self.timeout_s = timeout_s
        self.model = model  # what requests are served by: the base model's name, or a LoRA run's adapter's
        self.run = run  # every token's label must name a version of this run; None: only looks
        # Every token id must be below it (the model's, answers.vocab_size); None: not known.
        self.vocab_size = vocab_size
        self._admin_token = admin_token
        self._http = httpx.AsyncClient(
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {data_token}"} if data_token else None,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def generate(self, worker_id: str, url: str, request: GenerateRequest,
                       prompt_suffix: list[int] = ()) -> list[GenerateResponse]:
        """One request to one worker; `prompt_suffix` continues an aborted completion."""
        s = request.sampling
        sampling: dict[str, Any] = {
            "n": request.n,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_tokens": s.max_tokens - len(prompt_suffix),
            "stop_token_ids": list(s.stop_token_ids),
            "logprobs": 0 if s.logprobs else None,
            "ignore_eos": s.ignore_eos,
            # Token ids are the contract; detokenized text would only cost time.
            "detokenize": False,
        }
        if s.seed is not None:
            sampling["seed"] = s.seed
        body = {
            "model": self.model,
            "token_ids": list(request.prompt_token_ids) + list(prompt_suffix),
            "sampling_params": sampling,
            "request_id": request.request_id,
        }
        try:
            response = await self._post(worker_id, f"generate {request.request_id}", f"{url}/inference/v1/generate", body)
        except httpx.TransportError as e:
            raise FleetrlError(f"worker {worker_id}: generate {request.request_id} failed: "
                               f"{type(e).__name__} talking to {url}") from None
        if response.status_code != 200:
            raise FleetrlError(f"worker {worker_id}: generate {request.request_id} failed: "
                               f"HTTP {response.status_code}: {response.text[:300]}")
        if self.run is None:
            raise FleetrlError(f"worker {worker_id}: a client of no run cannot check the versions of what it samples")
        # vLLM names every completion's end ("abort" for one a publish cut), and labels every
        # token's version: a choice without either is a bad sample, never read as "abort".
        return answers.samples(worker_id, request, response.json()["choices"], request.n, self.run, self.vocab_size,
                               _choice, sampling["max_tokens"])

    async def prompt_logprobs(self, worker_id: str, url: str, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1, scored by the worker's current weights."""
        body = {
            "model": self.model,
            "token_ids": list(token_ids),
            "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0, "detokenize": False},
        }
        try:
            response = await self._post(worker_id, "scoring", f"{url}/inference/v1/generate", body)
        except httpx.TransportError as e:
            raise FleetrlError(f"worker {worker_id}: scoring failed: {type(e).__name__} talking to {url}") from None
        if response.status_code != 200:
            raise FleetrlError(f"worker {worker_id}: scoring failed: HTTP {response.status_code}: {response.text[:300]}")
        return prompt_logprobs_of(token_ids, response.json()["prompt_logprobs"])

    async def _post(self, worker_id: str, what: str, url: str, body: dict) -> httpx.Response:
        if self._admin_token is None:
            return await answered_within(self.timeout_s, self._http.post(url, json=body))
        nonce = admin_signature.fresh_nonce()
        response = await answered_within(self.timeout_s, self._http.post(
            url, json=body, headers={admin_signature.NONCE_HEADER: nonce}))
        if response.status_code != 401 and (why := unproven(response, self._admin_token, nonce)):
            raise ImpostorWorker(worker_id, what, why)
        return response


def _choice(raw: dict) -> Choice:
    """A choice of `/inference/v1/generate`; its checks are answers.py's."""
    content = (raw.get("logprobs") or {}).get("content") or []
    return Choice(token_ids=raw.get("token_ids"), logprobs=[entry["logprob"] for entry in content],
                  finish_reason=raw.get("finish_reason"), weight_versions=raw.get("weight_versions") or [])
