"""A conformance suite of failures that users of other RL frameworks met in production, each
reproduced here by fault injection against real vLLM servers (issue 27). Each case asserts
that no token reaches the optimizer under a wrong version — every response is either labelled
with a version the fleet published and verified, or flagged (`version_error`) and never trained
— and that nothing is lost or done twice. docs/reliability.md ("Conformance") names the failure
each case reproduces.

The cases ride on the operator's two servers (deployments.py), which test_weight_transfer.py
and test_kill_points.py use too, with one in-process coordinator attached to them. Class (e),
prompts lost on resume, rides on the kill-point sequence's run (test_kill_points.py calls
`check_no_prompt_lost_or_repeated` on it): it needs a run killed and resumed, which that
sequence already is. Class (f), answers corrupted on their way to fleetrl, puts a rewriting
reverse proxy in front of the same two servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import re
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import torch
from aiohttp import web

from fleetrl import admin_signature
from fleetrl.app.checks import run_environments
from fleetrl.app.providers import base_weights as base_weights_of
from fleetrl.config import InferenceConfig, load_config
from fleetrl.envs.mix import run_task_stream
from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet import AgreementProbe, Fleet, WeightSource
from fleetrl.inference.types import GenerateRequest, SamplingParams, WorkerState
from fleetrl.inference.vllm.provider import VllmProvider
from fleetrl.orchestrator.rollouts import Orchestrator, Scored
from fleetrl.processes import stop_all
from fleetrl.rundir import RunDir
from fleetrl.trainer.model import prompt_logprobs
from fleetrl.versions import VersionSpan
from fleetrl.weights.filesystem import sender as filesystem
from fleetrl.weights.checksum import checksum_of
from fleetrl.weights.factory import make_transport

from .conftest import chat_ids, model_with, perturbed
from .deployments import ADMIN, DATA, OPERATOR_SERVERS

pytestmark = [pytest.mark.deployment(OPERATOR_SERVERS), pytest.mark.asyncio(loop_scope="module")]
CPU = torch.device("cpu")
LONG = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)


def transport(tmp_path: Path, kind: str = "filesystem"):
    return make_transport(kind, host="127.0.0.1", bucket_bytes=64 << 20, storage_dir=tmp_path / f"weights-{kind}")


def agreement(base_weights, probe, version: int | None) -> AgreementProbe:
    """The trainer's logprobs of the first probe text under `version`'s weights (None: the base)."""
    model = base_weights if version is None else model_with(base_weights, perturbed(base_weights, seed=version))
    return AgreementProbe(probe[0], prompt_logprobs(model, probe[0], CPU))


def provider_of(urls: list[str], model_dir: Path, run_dir: Path) -> VllmProvider:
    """An attached coordinator's provider, as run `run_dir`'s (its run id, which the first one
    writes there as a run's first start does, and a resumed one reads back)."""
    run = RunDir(run_dir)
    run.record_run_id()
    return VllmProvider(InferenceConfig(urls=urls), model_dir, run_dir, ADMIN, DATA, run.run_id())


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def attached(operator_servers, model_dir, tmp_path_factory):
    """One coordinator on both operator servers, at v0 (the base weights, checked first)."""
    run_dir = tmp_path_factory.mktemp("conformance")
    provider = provider_of(operator_servers, model_dir, run_dir)
    fleet = Fleet(provider, discovery_interval_s=3600, log=lambda line: None)
    sent = transport(run_dir, "broadcast")  # every good publish and refit of the module's coordinator
    try:
        await fleet.start(base_weights_of(provider, model_dir, sent))
        yield fleet, run_dir, sent
    finally:
        await sent.close()
        await fleet.close()
        stop_all()


def trained(responses) -> list:
    """What the orchestrator would train: responses not flagged."""
    return [r for r in responses if r.version_error is None]


async def test_a_the_weights_a_worker_installs_are_the_weights_sent(attached, base_weights, probe, tokenizer,
                                                                   monkeypatch):
    """(a) Weights silently different from what the trainer sent after a sync. Fault: a byte of
    a stored shard flips between the trainer's write and the workers' load. Every worker finds
    it (the manifest's hashes, then each rank's checksum of what it loaded), none is labelled
    with the new version, and a request in flight across the publish is never trained at it."""
    fleet, run_dir, sent = attached
    write_version = filesystem.write_version

    def write_then_flip_a_byte(*args, **kwargs):
        manifest = write_version(*args, **kwargs)
        shard = next(p for p in manifest.folder.iterdir() if p.suffix == ".safetensors")
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0x01
        shard.write_bytes(bytes(data))
        return manifest

    monkeypatch.setattr(filesystem, "write_version", write_then_flip_a_byte)
    store = transport(run_dir)
    in_flight = asyncio.create_task(fleet.generate(GenerateRequest(story(tokenizer), LONG)))
    try:
        await asyncio.sleep(0.5)
        with pytest.raises(FleetrlError, match=r"^publish v1 failed: .*sha256 differs from the manifest \(corrupted "
                                               r"shard\)"):
            await fleet.publish(1, store, perturbed(base_weights, seed=1), agreement(base_weights, probe, 1))
        # (d) A version bumped after an update that failed to apply: no worker, nor the fleet,
        # counts v1; the workers take no request until they are refitted.
        assert fleet.version == 0
        for worker in fleet.workers.values():
            assert worker.state != WorkerState.READY and await fleet.provider.admin(worker).version() is None
    finally:
        monkeypatch.undo()
        await store.close()
    # A discovery round brings every worker back to v0, verified; the request held across the
    # failed publish ends at v0; then v1, sent whole, is v1.
    await fleet.refresh()
    assert all(w.state == WorkerState.READY and w.version == 0 for w in fleet.workers.values())
    for response in trained(await in_flight):
        assert all(span.version == 0 for span in response.spans), response.spans
    await publish_and_check(fleet, sent, base_weights, probe, tokenizer, version=1)


def story(tokenizer) -> list[int]:
    return chat_ids(tokenizer, "Tell a long story about a lighthouse.")


async def publish_and_check(fleet, sent, base_weights, probe, tokenizer, version: int, seed: int | None = None) -> None:
    """Publish `version` (the weights of `seed`, by default the version's own) by `sent`; every
    worker must then hold their checksum and answer at that version."""
    seed = version if seed is None else seed
    report = await fleet.publish(version, sent, perturbed(base_weights, seed=seed), agreement(base_weights, probe, seed))
    assert sorted(report.ready) == sorted(fleet.workers) and not report.failed, report
    expected = checksum_of(perturbed(base_weights, seed=seed)())
    for worker in fleet.workers.values():
        await fleet.provider.admin(worker).verify_weights(expected)
    responses = await asyncio.gather(*(fleet.generate(GenerateRequest(story(tokenizer), SamplingParams(max_tokens=4)))
                                       for _ in fleet.workers))
    assert all(r.version_error is None and r.spans == [VersionSpan(version, 0)] for (r,) in responses)


async def test_b_a_recovered_worker_serves_nothing_before_its_refit(attached, base_weights, tokenizer):
    """(b) A recovered engine that served before it was refitted. Fault: one worker comes back
    as a restarted vLLM server does, labelled `default` (its label reset behind the fleet's
    back, as its operator's restart would). Its first answer is refused and sent elsewhere, it
    takes no request until a discovery round has refitted and verified it, and then it serves
    the fleet's version."""
    fleet, run_dir, sent = attached
    version = fleet.version
    victim = sorted(fleet.workers)[0]
    admin = fleet.provider.admin(fleet.workers[victim])
    await admin.routes.call("POST", "/update_weight_version", idempotent=True, json={"new_version": "default"})
    responses = [r for (r,) in await asyncio.gather(
        *(fleet.generate(GenerateRequest(story(tokenizer), SamplingParams(max_tokens=4))) for _ in range(4)))]
    assert all(r.worker_id != victim and r.spans == [VersionSpan(version, 0)] for r in responses), responses
    assert fleet.workers[victim].state == WorkerState.STALE
    await fleet.refresh()
    assert fleet.workers[victim].state == WorkerState.READY and await admin.version() == version
    await admin.verify_weights(checksum_of(perturbed(base_weights, seed=version)()))


async def test_c_after_failover_the_version_never_goes_back_to_weights_it_did_not_train(attached, model_dir,
                                                                                       base_weights, probe, tokenizer):
    """(c) A version counter that went backwards after failover. Fault: the coordinator dies
    (never closed) after publishing v2; the run resumes from its checkpoint at v1, with a new
    coordinator of the same run. The workers, labelled v2 by the dead one, are refitted to v1
    before they serve, and the v2 the new coordinator publishes is its own weights, not the
    dead coordinator's v2 under the same number."""
    fleet, run_dir, sent = attached
    await publish_and_check(fleet, sent, base_weights, probe, tokenizer, version=2)  # the dead one's last
    resumed = Fleet(provider_of(sorted(w.admin_url for w in fleet.workers.values()), model_dir, run_dir),
                    discovery_interval_s=3600, log=lambda line: None)  # same run: takes the workers at once
    own = transport(run_dir / "resumed", "broadcast")
    checkpoint = dict(perturbed(base_weights, seed=1)())

    async def checkpoint_weights() -> WeightSource:  # what the resumed run's trainer hands its fleet
        return WeightSource(own, lambda: iter(checkpoint.items()), checksum_of(checkpoint.items()),
                            agreement(base_weights, probe, 1), 1)

    try:
        await resumed.start(checkpoint_weights)
        assert resumed.version == 1
        for worker in resumed.workers.values():
            assert worker.state == WorkerState.READY and worker.version == 1
            await resumed.provider.admin(worker).verify_weights(checksum_of(checkpoint.items()))
        (out,) = await resumed.generate(GenerateRequest(story(tokenizer), SamplingParams(max_tokens=4)))
        assert out.version_error is None and out.spans == [VersionSpan(1, 0)]
        # Its own v2, not the dead coordinator's weights under that number.
        await publish_and_check(resumed, own, base_weights, probe, tokenizer, version=2, seed=102)
    finally:
        await own.close()
        await resumed.close()


def check_no_prompt_lost_or_repeated(run_dir: Path, steps: int) -> None:
    """(e) Prompts lost on resume. A run killed and resumed (the kill-point sequence) trains, at
    each step, the tasks an uninterrupted run would: step n's first batch_prompts tasks of the
    seeded stream are (n - 1) * W onwards (W: `prompts_per_step`, batch_prompts without dynamic
    sampling), none is missing, and no task is trained at two steps."""
    config = load_config([run_dir / "config.toml"], [])
    orchestrator = config.orchestrator
    window = orchestrator.prompts_per_step()
    stream = run_task_stream(run_environments(config, RunDir(run_dir)), config.run.seed)
    expected = [next(stream).id for _ in range(steps * window)]
    seen: dict[str, int] = {}
    for step in range(1, steps + 1):
        records = [json.loads(line) for line in RunDir(run_dir).rollouts_path(step).read_text().splitlines()]
        tasks = {r["task"] for r in records if r.get("drop_reason") in (None, "filtered")}  # filtered: by design
        first = expected[(step - 1) * window: (step - 1) * window + orchestrator.batch_prompts]
        assert set(first) <= tasks, (step, first, sorted(tasks))
        for task in tasks:
            assert task not in seen, f"task {task} trained at steps {seen[task]} and {step}"
            seen[task] = step


class RewritingProxy:
    """A reverse proxy in front of one real server's data route, which rewrites the next answer
    of /inference/v1/generate that passes through it (`rewrite`, shared by every proxy of a
    test: whichever worker the fleet picks, its answer is the one changed) and passes the rest
    on as they are. It holds the run's admin token (as only a proxy the run trusts can), and
    proves each data answer for its own address as the server does, of the body it rewrote: what
    it changes reaches fleetrl's per-sample checks (a proxy without the token is found out
    before them: unit/test_tokens.py)."""

    def __init__(self, upstream: str, rewrites: list) -> None:
        self.upstream = upstream
        self.rewrites = rewrites
        self._http = httpx.AsyncClient(timeout=120)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def _relay(self, request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        answer = await self._http.request(request.method, f"{self.upstream}{request.rel_url}", headers=headers,
                                          content=await request.read())
        body = answer.content
        if request.path == "/inference/v1/generate" and answer.status_code == 200 and self.rewrites:
            changed = json.loads(body)
            self.rewrites.pop(0)(changed)
            body = json.dumps(changed).encode()
        out = {k: v for k, v in answer.headers.items() if k.lower() not in (
            "content-length", "content-encoding", "transfer-encoding", "connection", admin_signature.PROOF_HEADER)}
        if nonce := request.headers.get(admin_signature.NONCE_HEADER):
            out[admin_signature.PROOF_HEADER] = admin_signature.answer_proof(ADMIN, nonce, self.url.removeprefix("http://"),
                                                                             "", body)
        return web.Response(status=answer.status_code, body=body, headers=out)

    async def close(self) -> None:
        await self._http.aclose()
        if self._runner is not None:
            await self._runner.cleanup()


def nan_logprob(answer):
    answer["choices"][0]["logprobs"]["content"][1]["logprob"] = math.nan


def token_id_out_of_range(answer):
    answer["choices"][0]["token_ids"][1] = 10**9


def extra_choice(answer):
    answer["choices"].append(copy.deepcopy(answer["choices"][0]))


def missing_logprob(answer):
    answer["choices"][0]["logprobs"]["content"].pop()


def spans_not_at_0(answer):
    answer["choices"][0]["weight_versions"][0]["start"] = 1


def positive_logprob(answer):
    answer["choices"][0]["logprobs"]["content"][1]["logprob"] = 50.0


def span_ending_short(answer):
    answer["choices"][0]["weight_versions"][-1]["end"] -= 1


def a_token_more(answer):
    choice = answer["choices"][0]
    choice["token_ids"].append(choice["token_ids"][-1])
    choice["logprobs"]["content"].append(copy.deepcopy(choice["logprobs"]["content"][-1]))
    choice["weight_versions"][-1]["end"] += 1


# Each way a proxy between a run and its server corrupted (or could corrupt) one answer, and
# what the fleet says of the sample.
CORRUPTIONS = {
    "a NaN logprob": (nan_logprob, r"logprob 1 of 4 is nan, not a finite number"),
    "a token id of 10**9": (token_id_out_of_range, r"token 1 of 4 is 1000000000, not an id in the model's vocabulary"),
    "an extra choice": (extra_choice, r"2 choices for the 1 requested"),
    "a missing logprob": (missing_logprob, r"3 logprobs for 4 tokens"),
    "spans not starting at 0": (spans_not_at_0, r"span .* does not go on from token 0"),
    "a positive logprob": (positive_logprob, r"logprob 1 of 4 is 50.0, not a log-probability"),
    "a span ending short of the completion": (span_ending_short, r"version spans label 3 of 4 tokens"),
    "a token more than requested": (a_token_more, r"5 tokens for the 4 requested \(max_tokens\)"),
}


@contextlib.asynccontextmanager
async def behind_proxies(fleet, rewrites: list):
    """Every worker's data requests through a RewritingProxy of its own; admin calls go straight."""
    proxies = [RewritingProxy(w.admin_url, rewrites) for w in fleet.workers.values()]
    try:
        for worker, proxy in zip(fleet.workers.values(), proxies):
            worker.data_url = await proxy.start()
        yield
    finally:
        for worker, proxy in zip(fleet.workers.values(), proxies):
            worker.data_url = worker.admin_url
            await proxy.close()


def short(tokenizer) -> GenerateRequest:
    return GenerateRequest(story(tokenizer), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("case", CORRUPTIONS)
async def test_f_a_corrupted_answer_drops_its_sample_and_counts_against_its_worker(attached, tokenizer, case):
    """(f) A worker's answer corrupted on its way (issue 36, item 4): a NaN logprob ended a run
    ("loss is nan"), a token id of 10**9 ended one with an IndexError, an extra choice trained as
    a group of 5. A real server's answer, rewritten by a proxy in front of it: the sample is a
    bad one (`bad_answer`, never trained), counted against the worker that answered, which stays
    in the fleet, and the next request is served as ever."""
    fleet, _, _ = attached
    rewrite, why = CORRUPTIONS[case]
    before = dict(fleet.bad_answers)
    async with behind_proxies(fleet, [rewrite]):
        (out,) = await fleet.generate(short(tokenizer))
        assert re.match(rf"^worker {re.escape(out.worker_id)}: generate {out.request_id}: {why}", out.answer_error or ""), out
        assert out.token_ids == [] and out.spans == []
        assert Orchestrator.unusable(Scored(None, [], out, "", None)) == "bad_answer"
        assert fleet.bad_answers[out.worker_id] == before.get(out.worker_id, 0) + 1
        assert all(w.state == WorkerState.READY for w in fleet.workers.values())
        (after,) = await fleet.generate(short(tokenizer))
    assert after.answer_error is None and len(after.token_ids) == 4 and after.spans == [VersionSpan(fleet.version, 0)]


async def test_f_an_answer_relabelled_with_another_runs_version_is_sampled_again(attached, tokenizer):
    """(f) The same proxy labels an answer with another run's version: no sample of it is kept;
    its worker, which seems to hold another run's weights, is stale until a refit (counted
    against it the strongest way), the request is served by the other worker, and nothing
    crashes."""
    fleet, _, _ = attached
    seen = []

    def foreign_label(answer):
        for span in answer["choices"][0]["weight_versions"]:
            seen.append(span["version"])
            span["version"] = f"v{fleet.version}@otherrun"

    async with behind_proxies(fleet, [foreign_label]):
        (out,) = await fleet.generate(short(tokenizer))
    (stale,) = [w for w in fleet.workers.values() if w.state == WorkerState.STALE]
    assert seen and "run otherrun's, not this run's" in stale.error
    assert out.worker_id != stale.id and out.answer_error is None and out.spans == [VersionSpan(fleet.version, 0)]
    await fleet.refresh()
    assert all(w.state == WorkerState.READY and w.version == fleet.version for w in fleet.workers.values())
