"""Disaggregated serving on Dynamo with real processes: a frontend, one prefill and one decode
worker of fleetrl's worker kind, the prompt's KV crossing from prefill to decode through vLLM's
shared-storage connector, and every publish (broadcast and filesystem) reaching both workers.

Dynamo's own worker kind is the same worker without the per-token version layer; its prefill
and decode deployment is driven end to end by
the torchrun-dynamo run of runs.py (test_rl_e2e.py: every rollout
prefilled on the prefill worker, 2 broadcast publishes verified on both, the agreement probe
after each), so it gets no deployment of its own here: CI time."""

import pytest
import pytest_asyncio
import torch

from fleetrl.app.rl import apply_core_plan
from fleetrl.config import Config, DynamoConfig, InferenceConfig, RunConfig, VllmConfig
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import GenerateRequest, SamplingParams, WorkerRole, WorkerState
from fleetrl.versions import VersionSpan, new_run_id
from fleetrl.weights.factory import make_transport

from .conftest import chat_ids, model_with, perturbed, running
from .probes import probe_fleet

pytestmark = pytest.mark.asyncio(loop_scope="module")
MAX_TOKENS = 12


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pd_fleet(model_dir, tmp_path_factory):
    """One prefill + one decode worker of fleetrl's kind (spans from the decode engine)."""
    # fleetrl's kind takes only admin calls signed with the run's token, which its workers get by environment.
    inference = InferenceConfig(provider="dynamo", dynamo=DynamoConfig(worker="fleetrl", prefill_workers=1), workers=1,
                                vllm=VllmConfig(max_model_len=768), admin_timeout_s=120, startup_timeout_s=900,
                                admin_token="pd-admin-token")
    run_dir = tmp_path_factory.mktemp("dynamo-pd-run")
    config = Config(inference=inference, run=RunConfig(dir=run_dir))
    apply_core_plan(config, log=lambda line: None)  # each worker on a CPU of its own, as `fleetrl rl` places them
    provider = DynamoProvider(config.inference, model_dir, run_dir, new_run_id())
    pause_mode = config.inference.resolved_pause_mode()
    async with running(Fleet(provider, pause_mode=pause_mode, discovery_interval_s=3600)) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def long_prompt(tokenizer):
    """Long enough that whole KV blocks cross from prefill to decode (the connector moves
    whole blocks only)."""
    text = " ".join(f"Lighthouse {i} stands on cape {i * 7 % 13}." for i in range(40))
    return chat_ids(tokenizer, text + " Write a poem about these lighthouses.")


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == MAX_TOKENS  # no early end of sequence: the comparison covers every token
    return tokens


def workers_by_role(fleet):
    roles = {w.role: w for w in fleet.workers.values()}
    assert len(roles) == len(fleet.workers) == 2, fleet.workers
    return roles[WorkerRole.PREFILL], roles[WorkerRole.DECODE]


async def through_prefill_and_decode(fleet, prompt, run_dir):
    """A greedy completion that provably went prefill -> KV store -> decode."""
    prefill, decode = workers_by_role(fleet)
    (out,) = await fleet.generate(GenerateRequest(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                         ignore_eos=True)))
    assert out.worker_id == decode.id and out.prefill_worker_id == prefill.id
    # The prefill worker saved the prompt's KV for the decode worker to load.
    assert any((run_dir / "kv-store").glob("*/*.safetensors"))
    return out


async def test_prefill_and_decode_workers_are_discovered_ready(pd_fleet):
    prefill, decode = workers_by_role(pd_fleet)
    for worker in (prefill, decode):
        admin = pd_fleet.provider.admin(worker)
        assert worker.state == WorkerState.READY and worker.version == 0
        assert await admin.version() == 0
        assert (await admin.worker_kind()).token_versions  # fleetrl's kind
    assert pd_fleet.routable_workers() == [decode]  # requests are pinned to decode workers only


async def test_kv_from_the_prefill_worker_gives_the_models_greedy_tokens(pd_fleet, long_prompt, base_weights):
    out = await through_prefill_and_decode(pd_fleet, long_prompt, pd_fleet.provider.run_dir)
    assert out.spans == [VersionSpan(0, 0)]
    assert out.token_ids == hf_greedy(base_weights, long_prompt)


async def test_probe_agrees_with_transformers_at_v0(pd_fleet, base_weights, probe):
    results = await probe_fleet(pd_fleet, base_weights, probe)
    assert [r.worker_id for r in results] == [w.id for w in pd_fleet.routable_workers()]
    for r in results:
        assert r.max_abs_diff < 2e-3, r


@pytest.mark.parametrize("kind, version", [("broadcast", 1), ("filesystem", 2)])
async def test_publish_reaches_prefill_and_decode_workers(pd_fleet, long_prompt, base_weights, tmp_path_factory,
                                                          kind, version):
    transport = make_transport(kind, host="127.0.0.1", bucket_bytes=32 << 20,
                               storage_dir=tmp_path_factory.mktemp(f"weights-{kind}"))
    weights = perturbed(base_weights, seed=version)
    try:
        report = await pd_fleet.publish(version, transport, weights)
    finally:
        await transport.close()
    assert sorted(report.ready) == sorted(pd_fleet.workers) and not report.failed, report
    for worker in workers_by_role(pd_fleet):
        admin = pd_fleet.provider.admin(worker)
        assert worker.version == version and await admin.version() == version
        await admin.verify_weights(report.checksum)
    # The same prompt again: KV the connector stored under the old weights must not be
    # loaded, so the tokens are exactly the new policy's.
    out = await through_prefill_and_decode(pd_fleet, long_prompt, pd_fleet.provider.run_dir)
    assert out.spans == [VersionSpan(version, 0)]
    assert out.token_ids == hf_greedy(model_with(base_weights, weights), long_prompt)
