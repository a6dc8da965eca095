"""The Dynamo provider with real processes: a Dynamo frontend and two of Dynamo's own vLLM
workers on the embedded model, driven by the fleet coordinator, with real weight transfers
through the workers' RL admin routes."""

import asyncio

import psutil
import pytest
import pytest_asyncio

from fleetrl.config import InferenceConfig
from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo.launcher import wait_ready
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.probe import probe_fleet
from fleetrl.inference.types import GenerateRequest, SamplingParams, WorkerRole, WorkerState
from fleetrl.versions import VersionSpan
from fleetrl.weights.transport import make_transport

from .conftest import chat_ids, model_with, perturbed, running

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dynamo_fleet(model_dir, tmp_path_factory):
    """Frontend + 2 workers for the whole module (a third joins, two are killed, in that
    order at the end); always stopped, pass or fail."""
    config = InferenceConfig(provider="dynamo", workers=2, max_model_len=512, admin_timeout_s=120,
                             startup_timeout_s=900)
    provider = DynamoProvider(config, model_dir, tmp_path_factory.mktemp("dynamo-run"))
    async with running(Fleet(provider, pause_mode="wait", discovery_interval_s=3600)) as fleet:
        yield fleet


async def test_workers_are_discovered_ready_at_v0(dynamo_fleet):
    workers = list(dynamo_fleet.workers.values())
    assert len(workers) == 2
    for worker in workers:
        assert worker.state == WorkerState.READY and worker.version == 0
        assert worker.role == WorkerRole.AGGREGATED and worker.world_size == 1
        assert worker.url.startswith("http://127.0.0.1:")
        assert await dynamo_fleet.provider.admin(worker).version() == 0
    # Re-discovery keeps the workers' identities.
    assert sorted(w.id for w in await dynamo_fleet.provider.discover()) == sorted(w.id for w in workers)


async def test_generation_through_the_frontend_has_v0_spans(dynamo_fleet, tokenizer):
    prompt = chat_ids(tokenizer, "Tell me a fact about the sea.")
    requests = [GenerateRequest(prompt, SamplingParams(max_tokens=8, seed=i), n=2) for i in range(4)]
    outs = [o for group in await asyncio.gather(*(dynamo_fleet.generate(r) for r in requests)) for o in group]
    assert len(outs) == 8
    assert {o.worker_id for o in outs} == set(dynamo_fleet.workers)
    for out in outs:
        assert out.spans == [VersionSpan(0, 0)]
        assert 0 < len(out.token_ids) == len(out.logprobs) <= 8
        assert all(lp <= 0 for lp in out.logprobs)
        assert out.finish_reason in ("stop", "length")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (a,) = await dynamo_fleet.generate(GenerateRequest(prompt, greedy))
    (b,) = await dynamo_fleet.generate(GenerateRequest(prompt, greedy))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6


async def test_prompt_logprobs_score_the_greedy_continuation(dynamo_fleet, tokenizer):
    worker = next(iter(dynamo_fleet.workers.values()))
    prompt = chat_ids(tokenizer, "Name a colour.")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (out,) = await dynamo_fleet.generate(GenerateRequest(prompt, greedy))
    scored = await dynamo_fleet.provider.prompt_logprobs(worker, prompt + out.token_ids)
    assert len(scored) == len(prompt) + len(out.token_ids) - 1
    assert scored[-len(out.token_ids):] == pytest.approx(out.logprobs, abs=1e-3)


async def test_admin_plane_pauses_resumes_and_sets_versions(dynamo_fleet, tokenizer):
    worker = next(iter(dynamo_fleet.workers.values()))
    admin = dynamo_fleet.provider.admin(worker)
    assert await admin.health()
    # Dynamo's own worker kind: no per-token versions, so only `wait` pauses keep them exact.
    assert not await admin.reports_token_versions()
    for mode in ("keep", "abort"):
        with pytest.raises(FleetrlError, match="reports no per-token versions"):
            await admin.pause(mode)
    with pytest.raises(FleetrlError, match="not paused"):
        await admin.set_version(3)
    await admin.pause("wait")
    try:
        await admin.set_version(7)
        assert await admin.version() == 7
        await admin.set_version(0)
    finally:
        await admin.resume()
    assert await admin.version() == 0
    (out,) = await dynamo_fleet.generate(GenerateRequest(chat_ids(tokenizer, "Hi"), SamplingParams(max_tokens=4)))
    assert out.spans == [VersionSpan(0, 0)]
    # At v0 the worker holds the weights it loaded, not any a sender checksummed.
    with pytest.raises(FleetrlError, match="weight checksum None"):
        await admin.verify_weights("0" * 64)


async def test_probe_agrees_with_transformers_at_v0(dynamo_fleet, base_weights, probe):
    results = await probe_fleet(dynamo_fleet, base_weights, probe)
    assert {r.worker_id for r in results} == set(dynamo_fleet.workers)
    for r in results:
        assert r.max_abs_diff < 2e-3, r


@pytest.mark.parametrize("kind, versions", [("broadcast", (1, 2)), ("filesystem", (3,))])
async def test_publish_through_the_admin_routes(dynamo_fleet, base_weights, probe, tokenizer, tmp_path_factory,
                                                kind, versions):
    transport = make_transport(kind, host="127.0.0.1", bucket_bytes=32 << 20,
                               storage_dir=tmp_path_factory.mktemp(f"weights-{kind}"))
    try:
        for version in versions:
            weights = perturbed(base_weights, seed=version)
            report = await dynamo_fleet.publish(version, transport, weights)
            assert sorted(report.ready) == sorted(dynamo_fleet.workers) and not report.failed, report
            for worker in dynamo_fleet.workers.values():
                admin = dynamo_fleet.provider.admin(worker)
                assert worker.state == WorkerState.READY and worker.version == version
                assert await admin.version() == version
                await admin.verify_weights(report.checksum)
                with pytest.raises(FleetrlError, match="weight checksum"):
                    await admin.verify_weights("0" * 64)
            # The served weights are the published ones, not merely labelled so.
            for r in await probe_fleet(dynamo_fleet, model_with(base_weights, weights), probe):
                assert r.max_abs_diff < 2e-3, r
            for r in await probe_fleet(dynamo_fleet, base_weights, probe):
                assert r.mean_abs_diff > 0.05, r
            (out,) = await dynamo_fleet.generate(GenerateRequest(chat_ids(tokenizer, "Hi"),
                                                                 SamplingParams(max_tokens=4)))
            assert out.spans == [VersionSpan(version, 0)]
    finally:
        await transport.close()


async def test_request_in_flight_during_a_publish_is_attributed_to_the_version_that_produced_it(
        dynamo_fleet, base_weights, tokenizer, tmp_path_factory):
    """Sequence-level versions on a real worker: a publish lands while a greedy request runs;
    the `wait` pause drains it on the old weights, and its one span says so."""
    old = dynamo_fleet.version
    request = GenerateRequest(chat_ids(tokenizer, "Write a long story about a lighthouse."),
                              SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True), session_id="straddle")
    (reference,) = await dynamo_fleet.generate(request)
    in_flight = asyncio.create_task(dynamo_fleet.generate(request))
    await asyncio.sleep(1.5)
    transport = make_transport("filesystem", host="127.0.0.1", bucket_bytes=32 << 20,
                               storage_dir=tmp_path_factory.mktemp("weights-straddle"))
    await dynamo_fleet.publish(old + 1, transport, perturbed(base_weights, seed=old + 1))
    (out,) = await in_flight
    assert out.spans == [VersionSpan(old, 0)] and out.token_ids == reference.token_ids
    (after,) = await dynamo_fleet.generate(request)
    assert after.spans == [VersionSpan(old + 1, 0)] and after.token_ids != reference.token_ids


def worker_process(deployment, url: str):
    """The launched worker process whose system server listens at `url`."""
    port = int(url.rsplit(":", 1)[1])
    for process in deployment.workers:
        if process.alive() and any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                                   for c in psutil.Process(process.popen.pid).net_connections("tcp")):
            return process
    raise AssertionError(f"no launched worker listens at {url}")


async def test_worker_that_joins_is_refitted_before_it_serves(dynamo_fleet, base_weights, probe):
    """Runs after the publishes (the fleet is at v3): a third worker starts and is discovered."""
    version, known = dynamo_fleet.version, set(dynamo_fleet.workers)
    deployment = dynamo_fleet.provider.deployment
    deployment.add_worker()
    await wait_ready(deployment, len(known) + 1, timeout_s=900, log=lambda *_: None)
    (joined,) = [w for w in await dynamo_fleet.provider.discover() if w.id not in known]
    # Listed by Dynamo, but holding the base model and no fleetrl version: fleetrl sends it
    # nothing (requests are pinned to ready workers) until it is refitted.
    assert await dynamo_fleet.provider.admin(joined).version() is None
    await dynamo_fleet.refresh()
    worker = dynamo_fleet.workers[joined.id]
    assert worker.state == WorkerState.READY and worker.version == version
    admin = dynamo_fleet.provider.admin(worker)
    assert await admin.version() == version
    await admin.verify_weights(dynamo_fleet.checksum)
    results = await probe_fleet(dynamo_fleet, model_with(base_weights, perturbed(base_weights, seed=version)), probe)
    assert {r.worker_id for r in results} == known | {joined.id}
    for r in results:
        assert r.max_abs_diff < 2e-3, r


async def test_worker_killed_mid_rollout_does_not_fail_the_samples(dynamo_fleet, tokenizer):
    """One long request per worker; one worker dies under its request, which is sampled again,
    whole, on a ready worker: every completion is full length and at the fleet's version."""
    version, deployment = dynamo_fleet.version, dynamo_fleet.provider.deployment
    workers = dynamo_fleet.ready_workers()
    victim = workers[0]
    prompt = chat_ids(tokenizer, "Write a long story about a lighthouse.")
    sampling = SamplingParams(max_tokens=160, ignore_eos=True)
    requests = [asyncio.create_task(dynamo_fleet.generate(GenerateRequest(prompt, sampling)))
                for _ in workers]
    await asyncio.sleep(3.0)
    worker_process(deployment, victim.url).stop()
    outs = [o for (o,) in await asyncio.gather(*requests)]
    assert all(len(o.token_ids) == 160 and o.spans == [VersionSpan(version, 0)] for o in outs)
    assert victim.id not in {o.worker_id for o in outs}
    assert dynamo_fleet.workers[victim.id].state == WorkerState.DEAD


async def test_worker_killed_mid_publish_leaves_the_others_at_one_version(dynamo_fleet, base_weights, tokenizer,
                                                                          tmp_path_factory):
    old, deployment = dynamo_fleet.version, dynamo_fleet.provider.deployment
    survivors = dynamo_fleet.ready_workers()
    victim, survivors = survivors[0], survivors[1:]
    weights = perturbed(base_weights, seed=old + 1)

    victim_process = worker_process(deployment, victim.url)

    def killing_weights():  # the coordinator's retry iterates again: stopping twice is a no-op
        for i, item in enumerate(weights()):
            if i == 20:  # mid-transfer
                victim_process.stop()
            yield item

    transport = make_transport("broadcast", host="127.0.0.1", bucket_bytes=4 << 20,
                               storage_dir=tmp_path_factory.mktemp("weights-kill"))
    try:
        report = await dynamo_fleet.publish(old + 1, transport, killing_weights)
    finally:
        await transport.close()
    assert sorted(report.ready) == sorted(w.id for w in survivors) and victim.id in report.failed, report
    assert dynamo_fleet.workers[victim.id].state == WorkerState.DEAD
    for worker in survivors:
        await dynamo_fleet.provider.admin(worker).verify_weights(report.checksum)
    outs = await asyncio.gather(*(dynamo_fleet.generate(GenerateRequest(chat_ids(tokenizer, "Hi"),
                                                                        SamplingParams(max_tokens=4)))
                                  for _ in range(4)))
    assert all(o.spans == [VersionSpan(old + 1, 0)] and o.worker_id != victim.id for (o,) in outs)
