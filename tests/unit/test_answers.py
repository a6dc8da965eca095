"""A worker's answer checked sample by sample (fleetrl/inference/answers.py), through both
providers' data clients, the fleet and the orchestrator: a bad answer drops its sample
(`bad_answer`), counts against its worker and never ends the run. Before, one NaN logprob
ended a run ("loss is nan"), one token id of 10**9 ended it with an IndexError, and one extra
choice trained as a group of 5."""

import dataclasses
import json
import math
import re

import httpx
import pytest

from fleetrl.errors import FleetrlError
from fleetrl.inference import answers
from fleetrl.inference.dynamo.data import DynamoDataClient
from fleetrl.inference.dynamo.worker_kinds import FLEETRLS
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.fleet.routing import BAD_ANSWERS_BEFORE_STALE
from fleetrl.inference.types import GenerateRequest, SamplingParams, UnversionedTokens, WorkerState
from fleetrl.inference.vllm.data import VllmDataClient
from fleetrl.versions import VersionSpan

from .fake_fleet import FakeProvider
from .test_episodes import SPECIAL, Retry
from .test_episodes import make as make_episodes
from .test_orchestrator import make, records

VOCAB = 100
GOOD = {"tokens": [5, 6, 7], "logprobs": [-0.5, -0.25, -1.0], "finish": "length",
        "versions": [{"version": "v2@r1", "start": 0, "end": 3}], "copies": 1}
# Each way an answer was (or could be) corrupted between a worker and fleetrl, and what is said.
BAD = {
    "a NaN logprob": ({"logprobs": [-0.5, math.nan, -1.0]}, "logprob 1 of 3 is nan, not a finite number"),
    "an infinite logprob": ({"logprobs": [-0.5, -math.inf, -1.0]}, "logprob 1 of 3 is -inf, not a finite number"),
    "a token id of 10**9": ({"tokens": [5, 10**9, 7]},
                            "token 1 of 3 is 1000000000, not an id in the model's vocabulary \\(0..99\\)"),
    "a negative token id": ({"tokens": [5, -1, 7]}, "token 1 of 3 is -1, not an id"),
    "an extra choice": ({"copies": 2}, "2 choices for the 1 requested"),
    "a missing logprob": ({"logprobs": [-0.5, -0.25]}, "2 logprobs for 3 tokens"),
    "spans not starting at 0": ({"versions": [{"version": "v2@r1", "start": 1, "end": 3}]},
                                "span .* does not go on from token 0"),
    "spans going back": ({"versions": [{"version": "v2@r1", "start": 0, "end": 2}, {"version": "v3@r1", "start": 2, "end": 3},
                                       {"version": "v4@r1", "start": 1, "end": 3}]}, "span .* does not go on from token 3"),
    "a span past the completion": ({"versions": [{"version": "v2@r1", "start": 0, "end": 3},
                                                 {"version": "v3@r1", "start": 3, "end": 4}]},
                                   "version spans label 4 of 3 tokens"),
    "a span without its start": ({"versions": [{"version": "v2@r1"}]}, "an unreadable choice \\(KeyError"),
    # Issue 36, item 4, as a reviewer found it: each of these was a good sample.
    "versions going back": ({"versions": [{"version": "v3@r1", "start": 0, "end": 1},
                                          {"version": "v2@r1", "start": 1, "end": 3}]},
                            "version spans go back from v3 to v2"),
    "a span ending short of the completion": ({"versions": [{"version": "v2@r1", "start": 0, "end": 1}]},
                                              "version spans label 1 of 3 tokens"),
    "a gap between spans": ({"versions": [{"version": "v2@r1", "start": 0, "end": 1},
                                          {"version": "v3@r1", "start": 2, "end": 3}]},
                            "span .* does not go on from token 1"),
    "a positive logprob": ({"logprobs": [-0.5, 50.0, -1.0]},
                           "logprob 1 of 3 is 50.0, not a log-probability \\(at most 0, finite as a float32\\)"),
    "a logprob that is -inf as a float32": ({"logprobs": [-0.5, -1e300, -1.0]}, "logprob 1 of 3 is -1e\\+300, not a "
                                                                                "log-probability"),
    "more tokens than requested": ({"tokens": [5, 6, 7, 8], "logprobs": [-0.5] * 4,
                                    "versions": [{"version": "v2@r1", "start": 0, "end": 4}]},
                                   "4 tokens for the 3 requested \\(max_tokens\\)"),
    "a finished completion of no tokens": ({"tokens": [], "logprobs": [], "versions": []},
                                           "a completion of no tokens that finished \\('length'\\), not cut by an "
                                           "abort"),
}


def vllm_answer(tokens, logprobs, finish, versions, copies) -> dict:
    return {"choices": [{"token_ids": tokens, "finish_reason": finish, "weight_versions": versions,
                         "logprobs": {"content": [{"logprob": x} for x in logprobs]}}] * copies}


def dynamo_answer(tokens, logprobs, finish, versions, copies) -> dict:
    return {"choices": [{"finish_reason": finish, "logprobs": {"token_logprobs": logprobs}}] * copies,
            "nvext": {"completion_token_ids": tokens, "worker_id": {"decode_worker_id": 7},
                      "engine_data": {"weight_versions": versions, "engine_finish_reason": finish}}}


def answering(body: dict) -> httpx.MockTransport:
    # By hand: a worker's JSON may hold NaN, which httpx's own encoder refuses to write.
    return httpx.MockTransport(lambda request: httpx.Response(200, content=json.dumps(body).encode(),
                                                              headers={"content-type": "application/json"}))


async def answer(provider: str, n: int = 1, suffix: list[int] = (), **change):
    """What each provider's data client makes of an answer of GOOD with `change` (to a
    continuation of `suffix` where given)."""
    fields = {**GOOD, **change}
    request = GenerateRequest([1, 2], SamplingParams(max_tokens=3 + len(suffix)), n=n, request_id="r")
    if provider == "vllm":
        client = VllmDataClient("data-token", 30, "r1", vocab_size=VOCAB)
        await client._http.aclose()
        client._http = httpx.AsyncClient(transport=answering(vllm_answer(**fields)))
        try:
            return await client.generate("vllm-0", "http://worker", request, suffix)
        finally:
            await client.close()
    async with DynamoDataClient("http://f", "policy", timeout_s=1, run="r1", vocab_size=VOCAB) as client:
        await client._http.aclose()
        client._http = httpx.AsyncClient(base_url="http://f", transport=answering(dynamo_answer(**fields)))
        return [await client.complete("7", None, request, list(suffix), 0, FLEETRLS)]


@pytest.mark.parametrize("provider", ["vllm", "dynamo"])
async def test_a_whole_answer_is_a_sample(provider):
    (out,) = await answer(provider)
    assert (out.token_ids, out.logprobs, out.finish_reason, out.spans, out.answer_error) == (
        [5, 6, 7], [-0.5, -0.25, -1.0], "length", [VersionSpan(2, 0)], None)


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("provider", ["vllm", "dynamo"])
async def test_a_bad_answer_is_a_bad_sample_saying_why(provider, case):
    change, why = BAD[case]
    (out,) = await answer(provider, **change)
    worker = "vllm-0" if provider == "vllm" else "7"
    assert out.answer_error is not None and (out.token_ids, out.logprobs, out.spans) == ([], [], [])
    assert re.match(rf"^worker {worker}: generate r: {why}", out.answer_error), out.answer_error


async def test_more_or_fewer_choices_than_requested_make_every_requested_sample_bad():
    """Which one is the extra is unknowable: none is kept, and the group keeps its size."""
    for copies in (3, 1):
        out = await answer("vllm", n=2, copies=copies)
        assert len(out) == 2 and all(r.answer_error == f"worker vllm-0: generate r: {copies} choices for the 2 requested"
                                     for r in out)


@pytest.mark.parametrize("provider", ["vllm", "dynamo"])
async def test_a_completion_without_a_finish_reason_is_a_bad_sample(provider):
    """It was read as "abort" once (on Dynamo until issue 36's review), and the completion continued."""
    (out,) = await answer(provider, finish=None)
    worker = "vllm-0" if provider == "vllm" else "7"
    assert out.answer_error == f"worker {worker}: generate r: a completion without a finish_reason"


@pytest.mark.parametrize("provider", ["vllm", "dynamo"])
async def test_what_a_real_worker_may_send_is_a_sample(provider):
    """A completion an abort cut before its first token (continued by the fleet), and a logprob
    a float rounding above 0."""
    (cut,) = await answer(provider, tokens=[], logprobs=[], versions=[], finish="abort")
    assert (cut.token_ids, cut.finish_reason, cut.spans, cut.answer_error) == ([], "abort", [], None)
    (rounded,) = await answer(provider, logprobs=[-0.5, answers.LOGPROB_ROUNDING, -0.0])
    assert rounded.answer_error is None and rounded.logprobs == [-0.5, answers.LOGPROB_ROUNDING, 0.0]


@pytest.mark.parametrize("provider", ["vllm", "dynamo"])
async def test_a_continuation_may_answer_only_the_tokens_left(provider):
    """Continuing 2 tokens of a request for 5, the worker is asked for 3: 5 more are bad."""
    (out,) = await answer(provider, suffix=[8, 9])
    assert out.answer_error is None and out.token_ids == [5, 6, 7]
    (out,) = await answer(provider, suffix=[8, 9], tokens=[5] * 5, logprobs=[-0.5] * 5,
                          versions=[{"version": "v2@r1", "start": 0, "end": 5}])
    assert out.answer_error is not None and out.answer_error.endswith("5 tokens for the 3 requested (max_tokens)")


@pytest.mark.parametrize("provider", ["vllm", "dynamo"])
async def test_a_label_of_another_run_is_a_worker_at_other_weights(provider):
    """Not a bad sample: the worker goes stale and the request is sent again (Routing._generate_once)."""
    with pytest.raises(UnversionedTokens, match="run other's, not this run's"):
        await answer(provider, versions=[{"version": "v2@other", "start": 0, "end": 3}])


def test_the_vocab_size_is_the_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    assert answers.vocab_size(tmp_path) == 49152
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 7}}))
    assert answers.vocab_size(tmp_path) == 7
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception, match=r"config.json: vocab_size is None, not a positive integer"):
        answers.vocab_size(tmp_path)


# -- the fleet ---------------------------------------------------------------------------------

def bad(request, worker_id="a", why="logprob 1 of 3 is nan, not a finite number"):
    return answers.bad_sample(worker_id, request, why)


async def fleet_of(*ids, pause_mode="keep"):
    logged = []
    provider = FakeProvider(*ids)
    fleet = Fleet(provider, pause_mode=pause_mode, discovery_interval_s=3600, log=logged.append)
    await fleet.start()
    return fleet, provider, logged


async def test_a_bad_answer_counts_against_its_worker_and_is_not_sent_again():
    fleet, provider, logged = await fleet_of("a")
    calls = []

    async def corrupted(worker, request, suffix=(), prefill=None):
        calls.append(worker.id)
        return [bad(request)]

    provider.generate = corrupted
    request = GenerateRequest([1, 2, 3], SamplingParams(max_tokens=3), request_id="r")
    (out,) = await fleet.generate(request)
    assert out.answer_error == "worker a: generate r: logprob 1 of 3 is nan, not a finite number"
    assert calls == ["a"] and fleet.bad_answers == {"a": 1} and fleet.transient_errors == 0
    assert fleet.workers["a"].state == WorkerState.READY  # it answered its health check
    assert "fleetrl: worker a: generate r: logprob 1 of 3 is nan, not a finite number; 1 sample(s) dropped " \
           "(bad_answer)" in logged

    provider.engines["a"].alive = False  # a worker that sends garbage and then no longer answers
    await fleet.generate(request)
    assert fleet.bad_answers == {"a": 2} and fleet.workers["a"].state == WorkerState.DEAD
    await fleet.close()


async def test_a_worker_that_keeps_answering_badly_is_stale_until_refitted():
    """It stayed routable however many answers in a row it spoiled; one good answer resets the count."""
    fleet, provider, logged = await fleet_of("a")
    real, answers_bad = provider.generate, []

    async def corrupted_when_told(worker, request, suffix=(), prefill=None):
        out = await real(worker, request, suffix, prefill)
        return [bad(request) for _ in out] if answers_bad.pop(0) else out

    provider.generate = corrupted_when_told
    request = GenerateRequest([1, 2, 3], SamplingParams(max_tokens=3), request_id="r")
    answers_bad.extend([True] * (BAD_ANSWERS_BEFORE_STALE - 1) + [False] + [True] * (BAD_ANSWERS_BEFORE_STALE - 1))
    for _ in answers_bad[:]:
        await fleet.generate(request)
    assert fleet.workers["a"].state == WorkerState.READY and fleet.bad_answers == {"a": 2 * BAD_ANSWERS_BEFORE_STALE - 2}

    answers_bad.append(True)
    (out,) = await fleet.generate(request)
    assert out.answer_error is not None and fleet.workers["a"].state == WorkerState.STALE
    assert f"fleetrl: worker a is stale: answered badly {BAD_ANSWERS_BEFORE_STALE} times in a row (the last: worker " \
           "a: generate r: logprob 1 of 3 is nan, not a finite number)" in logged
    await fleet.refresh()  # the discovery loop's round: refitted, it serves again
    answers_bad.append(False)
    assert fleet.workers["a"].state == WorkerState.READY and (await fleet.generate(request))[0].answer_error is None
    await fleet.close()


async def test_a_bad_answer_to_an_aborted_completions_continuation_makes_it_a_bad_sample():
    """Before, the continuation's answer was unpacked as `(rest,)`: two choices raised a ValueError."""
    fleet, provider, _ = await fleet_of("a", pause_mode="abort")
    real = provider.generate

    async def cut_then_corrupted(worker, request, suffix=(), prefill=None):
        if not suffix:
            (head,) = await real(worker, request, suffix, prefill)
            return [dataclasses.replace(head, token_ids=head.token_ids[:2], logprobs=head.logprobs[:2],
                                        finish_reason="abort")]
        return answers.samples(worker.id, request, [{}, {}], request.n, "fake-run", None, None, 3)

    provider.generate = cut_then_corrupted
    (out,) = await fleet.generate(GenerateRequest([1, 2, 3], SamplingParams(max_tokens=5), request_id="r"))
    assert out.request_id == "r" and out.token_ids == [] and out.spans == []
    assert out.answer_error == "worker a: generate r-2: 2 choices for the 1 requested"
    await fleet.close()


# -- the orchestrator --------------------------------------------------------------------------

async def test_a_bad_sample_is_dropped_with_its_reason_and_the_batch_goes_on():
    logged = []
    fleet, orch, _ = await make(log=logged.append)
    generate = fleet.provider.generate
    corrupted = []

    async def first_answer_has_a_bad_sample(worker, request, suffix=(), prefill=None):
        first, *others = await generate(worker, request, suffix, prefill)
        if corrupted:
            return [first, *others]
        corrupted.append(worker.id)
        return [bad(request, worker.id, "token 0 of 6 is 1000000000, not an id in the model's vocabulary"), *others]

    fleet.provider.generate = first_answer_has_a_bad_sample
    batch = await orch.make_batch(1)
    dropped = [r for r in records(orch, 1) if r["drop_reason"] == "bad_answer"]
    assert len(dropped) == 1 and len(batch.samples) == 11 and batch.meta.dropped_by == {"bad_answer": 1}
    (record,) = dropped
    assert record["worker"] == corrupted[0] and not record["trained"] and record["completion_tokens"] == 0
    assert record["answer_error"].endswith("token 0 of 6 is 1000000000, not an id in the model's vocabulary")
    assert fleet.bad_answers == {corrupted[0]: 1}
    assert any(line.startswith("fleetrl: batch 1: dropped 1 sample(s) a worker answered badly (the first: worker ")
               for line in logged), logged
    await fleet.close()


async def test_a_turn_its_worker_answered_badly_ends_its_episode_bad_answer():
    """A multi-turn episode keeps its turns before the bad one; it is dropped, never trained."""
    env = Retry()
    fleet, orch, _ = await make_episodes(env, max_turns=3)
    generate = fleet.provider.generate

    async def second_turns_are_bad(worker, request, suffix=(), prefill=None):
        out = await generate(worker, request, suffix, prefill)
        second = request.prompt_token_ids.count(SPECIAL["<|im_start|>"]) > 2  # a later turn: its prompt holds the ones before
        return [bad(request, worker.id) for _ in out] if second else out

    fleet.provider.generate = second_turns_are_bad
    with pytest.raises(FleetrlError, match="4 bad_answer"):  # every episode of the batch: none to train
        await orch.make_batch(1)
    rows = records(orch, 1)
    assert {(r["drop_reason"], r["end"], len(r["turns"])) for r in rows} == {("bad_answer", "bad_answer", 1)}
    assert all(r["answer_error"] == r["episode_error"] and r["answer_error"].endswith("not a finite number")
               for r in rows)
    await fleet.close()
