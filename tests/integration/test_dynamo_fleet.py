"""The Dynamo provider with real processes: a Dynamo frontend and one of Dynamo's own vLLM
workers on the embedded model, driven by the fleet coordinator."""

import pytest
import pytest_asyncio

from fleetrl.config import InferenceConfig
from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import GenerateRequest, SamplingParams, VersionSpan, WorkerRole, WorkerState

from .conftest import chat_ids, running

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def dynamo_fleet(model_dir, tmp_path_factory):
    """Frontend + 1 worker for the whole module; always stopped, pass or fail."""
    config = InferenceConfig(provider="dynamo", workers=1, max_model_len=512, admin_timeout_s=120,
                             startup_timeout_s=900)
    provider = DynamoProvider(config, model_dir, tmp_path_factory.mktemp("dynamo-run"))
    async with running(Fleet(provider, pause_mode="wait", discovery_interval_s=3600)) as fleet:
        yield fleet


async def test_worker_is_discovered_ready_at_v0(dynamo_fleet):
    (worker,) = dynamo_fleet.workers.values()
    assert worker.state == WorkerState.READY and worker.version == 0
    assert worker.role == WorkerRole.AGGREGATED and worker.world_size == 1
    assert worker.url.startswith("http://127.0.0.1:")
    # Re-discovery keeps the worker's identity.
    assert [w.id for w in await dynamo_fleet.provider.discover()] == [worker.id]
    assert await dynamo_fleet.provider.admin(worker).version() == 0


async def test_generation_through_the_frontend_has_v0_spans(dynamo_fleet, tokenizer):
    (worker,) = dynamo_fleet.workers.values()
    prompt = chat_ids(tokenizer, "Tell me a fact about the sea.")
    outs = await dynamo_fleet.generate(GenerateRequest(prompt, SamplingParams(max_tokens=8, seed=1), n=2))
    assert len(outs) == 2
    for out in outs:
        assert out.worker_id == worker.id
        assert out.spans == [VersionSpan(0, 0)]
        assert 0 < len(out.token_ids) == len(out.logprobs) <= 8
        assert all(lp <= 0 for lp in out.logprobs)
        assert out.finish_reason in ("stop", "length")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (a,) = await dynamo_fleet.generate(GenerateRequest(prompt, greedy))
    (b,) = await dynamo_fleet.generate(GenerateRequest(prompt, greedy))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6


async def test_prompt_logprobs_score_the_greedy_continuation(dynamo_fleet, tokenizer):
    (worker,) = dynamo_fleet.workers.values()
    prompt = chat_ids(tokenizer, "Name a colour.")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (out,) = await dynamo_fleet.generate(GenerateRequest(prompt, greedy))
    scored = await dynamo_fleet.provider.prompt_logprobs(worker, prompt + out.token_ids)
    assert len(scored) == len(prompt) + len(out.token_ids) - 1
    assert scored[-len(out.token_ids):] == pytest.approx(out.logprobs, abs=1e-3)


async def test_admin_plane_pauses_resumes_and_sets_versions(dynamo_fleet, tokenizer):
    (worker,) = dynamo_fleet.workers.values()
    admin = dynamo_fleet.provider.admin(worker)
    assert await admin.health()
    with pytest.raises(FleetrlError, match="pause_mode"):
        await admin.pause("keep")
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
    with pytest.raises(FleetrlError, match="per-rank results"):
        await admin.collective_rpc("fleetrl_weight_checksum")
