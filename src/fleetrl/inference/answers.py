"""A worker's answer, checked sample by sample before any of it reaches a batch.

Both providers' data clients read what a worker sends back through here: the number of choices
(exactly the samples requested), and in each choice no more token ids than requested, inside
the model's vocabulary, one logprob per token (where logprobs were asked for) that is a
log-probability the trainer can hold (at most 0, finite as a float32), a finish reason, tokens
unless it is "abort" (a finished completion holds at least its last token), and version spans
that label every token once, in order, at versions that never go back, each a version of this
run. A choice that breaks any of these is a bad sample (`bad_sample`: no
tokens, `answer_error` says why), never an error of the request: the fleet counts it against
its worker, the orchestrator drops it (`bad_answer`), and the other samples of the answer
stand. An answer with another number of choices than requested has no sample to trust (which
one is the extra?): each requested sample is a bad one. A label that names no version of this
run is no bad sample but a worker at weights not this run's (a restart, another run): it
raises `UnversionedTokens`, the worker goes stale until refitted and the request is sent again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetrl.errors import FleetrlError
from fleetrl.inference.types import GenerateRequest, GenerateResponse, UnversionedTokens, engine_spans


@dataclass(frozen=True)
class Choice:
    """One choice of an answer, read from its provider's wire format, not checked yet."""

    token_ids: object
    logprobs: object  # one per token, where the request asked for them
    finish_reason: object
    weight_versions: object | None  # the engine's per-token record; None: the provider attributes versions


# How far above 0 a logprob may be, its float rounding, and still be read as a log-probability.
LOGPROB_ROUNDING = 1e-4
# The largest finite float32: a logprob below its negative is -inf in the trainer's float32.
FLOAT32_MAX = 3.4028234663852886e38


class BadAnswer(FleetrlError):
    """Why one choice cannot be a sample."""


def vocab_size(model_dir: Path) -> int:
    """The size of the model's vocabulary (config.json `vocab_size`): a token id at or past it
    indexes nothing in the trainer's embedding."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FleetrlError(f"{path}: cannot read the model's vocab_size ({e})") from None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise FleetrlError(f"{path}: vocab_size is {size!r}, not a positive integer")
    return size


def samples(worker_id: str, request: GenerateRequest, choices: object, expected: int, run: str | None,
            vocab: int | None, read: Callable[[dict], Choice], max_tokens: int) -> list[GenerateResponse]:
    """The `expected` samples of an answer whose `choices` each `read` turns into a Choice.
    `max_tokens`: the tokens the worker was asked for (fewer than the request's in a
    continuation); `run`: the run every span's label must name (None: spans are the provider's, no labels);
    `vocab`: the model's vocabulary size, None where the model is not known (a readiness check):
    token ids are then only held to be non-negative."""
    if not isinstance(choices, list) or len(choices) != expected:
        what = f"{len(choices)} choices" if isinstance(choices, list) else f"choices {str(choices)[:50]!r}"
        return [bad_sample(worker_id, request, f"{what} for the {expected} requested") for _ in range(expected)]
    return [sample(worker_id, request, choice, run, vocab, read, max_tokens) for choice in choices]


def sample(worker_id: str, request: GenerateRequest, raw: object, run: str | None, vocab: int | None,
           read: Callable[[dict], Choice], max_tokens: int) -> GenerateResponse:
    """One choice as a sample: checked, or a bad sample saying why not."""
    try:
        if not isinstance(raw, dict):
            raise BadAnswer(f"a choice that is {type(raw).__name__}, not an object")
        choice = read(raw)
        token_ids = _token_ids(choice.token_ids, vocab)
        if len(token_ids) > max_tokens:
            raise BadAnswer(f"{len(token_ids)} tokens for the {max_tokens} requested (max_tokens)")
        logprobs = _logprobs(choice.logprobs, len(token_ids)) if request.sampling.logprobs else []
        if not isinstance(choice.finish_reason, str) or not choice.finish_reason:
            raise BadAnswer("a completion without a finish_reason")
        if not token_ids and choice.finish_reason != "abort" and max_tokens > 0:
            raise BadAnswer(f"a completion of no tokens that finished ({choice.finish_reason!r}), not cut by an abort")
        response = GenerateResponse(request_id=request.request_id, token_ids=token_ids, logprobs=logprobs,
                                    finish_reason=choice.finish_reason, worker_id=worker_id, spans=[])
        if choice.weight_versions is not None:
            if not isinstance(choice.weight_versions, list):
                raise BadAnswer(f"weight_versions is {choice.weight_versions!r}, not a list")
            response.spans = engine_spans(worker_id, request.request_id, choice.weight_versions, run, len(token_ids))
            if token_ids:
                response.check()
        return response
    except UnversionedTokens:
        raise
    except (FleetrlError, KeyError, TypeError, ValueError, AttributeError) as e:
        why = str(e).removeprefix(f"request {request.request_id}: ") if isinstance(e, FleetrlError) \
            else f"an unreadable choice ({type(e).__name__}: {e})"
        return bad_sample(worker_id, request, why)


def bad_sample(worker_id: str, request: GenerateRequest, why: str) -> GenerateResponse:
    """A sample the worker answered badly: nothing of it is kept but why."""
    return GenerateResponse(request_id=request.request_id, token_ids=[], logprobs=[], finish_reason="error",
                            worker_id=worker_id, spans=[],
                            answer_error=f"worker {worker_id}: generate {request.request_id}: {why}")


def _token_ids(token_ids: object, vocab: int | None) -> list[int]:
    if not isinstance(token_ids, list):
        raise BadAnswer(f"token_ids is {token_ids!r}, not a list")
    for i, token in enumerate(token_ids):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0 or (vocab is not None and token >= vocab):
            raise BadAnswer(f"token {i} of {len(token_ids)} is {token!r}, not an id in the model's vocabulary "
                            f"(0..{vocab - 1 if vocab is not None else 'any'})")
    return token_ids


def _logprobs(logprobs: object, tokens: int) -> list[float]:
    if not isinstance(logprobs, list) or len(logprobs) != tokens:
        count = len(logprobs) if isinstance(logprobs, list) else "no"
        raise BadAnswer(f"{count} logprobs for {tokens} tokens")
    for i, logprob in enumerate(logprobs):
        if not isinstance(logprob, (int, float)) or isinstance(logprob, bool) or not math.isfinite(logprob):
            raise BadAnswer(f"logprob {i} of {tokens} is {logprob!r}, not a finite number")
        if logprob > LOGPROB_ROUNDING or logprob < -FLOAT32_MAX:
            raise BadAnswer(f"logprob {i} of {tokens} is {logprob!r}, not a log-probability (at most 0, finite as "
                            "a float32)")
    return [float(logprob) for logprob in logprobs]
