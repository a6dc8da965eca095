"""The native fleet end to end: two real vLLM CPU servers, real weight transfers between real
processes, exact per-token versions, and a worker killed in the middle of a publish."""

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from fleetrl.config import InferenceConfig
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.probe import probe_fleet
from fleetrl.inference.types import GenerateRequest, SamplingParams, WorkerState
from fleetrl.versions import VersionSpan
from fleetrl.inference.vllm.provider import VllmProvider
from fleetrl.weights.transport import make_transport

from .conftest import (chat_ids, check_abort_mode_joins_spans, check_keep_mode_span_boundary,
                       greedy_response, model_with, perturbed)

WORKERS = 2
pytestmark = pytest.mark.asyncio(loop_scope="module")
async def test_generation_spreads_over_workers_with_v0_spans(native_fleet, tokenizer):
    prompt = chat_ids(tokenizer, "Tell me a fact about the sea.")
    requests = [GenerateRequest(prompt, SamplingParams(max_tokens=8, seed=i), n=2) for i in range(6)]
    results = await asyncio.gather(*(native_fleet.generate(r) for r in requests))
    outs = [o for group in results for o in group]
    assert len(outs) == 12
    assert {o.worker_id for o in outs} == {"vllm-0", "vllm-1"}
    for out in outs:
        assert out.spans == [VersionSpan(0, 0)]
        assert len(out.logprobs) == len(out.token_ids) > 0
        assert all(lp <= 0 for lp in out.logprobs)
        assert out.finish_reason in ("stop", "length")


async def test_attach_mode_and_status_see_the_same_workers(native_fleet, tokenizer, model_dir, tmp_path):
    """A second coordinator attached by URL (servers started elsewhere) serves at v0 too."""
    urls = [w.url for w in native_fleet.workers.values()]
    token = native_fleet.provider.token
    config = InferenceConfig(urls=urls, admin_token=token)
    attached = Fleet(VllmProvider(config, model_dir, tmp_path, token), discovery_interval_s=3600,
                     log=lambda *_: None)
    await attached.start()
    try:
        assert sorted(w.id for w in attached.ready_workers()) == sorted(urls)
        (out,) = await attached.generate(GenerateRequest(chat_ids(tokenizer, "Hi"), SamplingParams(max_tokens=4)))
        assert out.worker_id in urls and out.spans == [VersionSpan(0, 0)]
    finally:
        await attached.close()
    assert not attached.provider.launched  # attaching starts nothing, and closing stops nothing
    assert all(w.state == WorkerState.READY for w in native_fleet.workers.values())
    status = subprocess.run([sys.executable, "-m", "fleetrl", "status", "--inference.urls", json.dumps(urls),
                             "--inference.admin_token", token], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("up  version=v0  serving") == 2


async def test_admin_routes_refuse_requests_without_the_token(native_fleet):
    url = native_fleet.workers["vllm-0"].url
    async with httpx.AsyncClient(base_url=url) as client:
        assert (await client.get("/health")).status_code == 200
        for method, path in [("POST", "/pause"), ("POST", "/update_weights"), ("POST", "/collective_rpc"),
                             ("GET", "/weight_info"), ("POST", "/inference/v1/generate")]:
            assert (await client.request(method, path)).status_code == 401, path
            wrong = {"Authorization": "Bearer wrong"}
            assert (await client.request(method, path, headers=wrong)).status_code == 401, path
    assert not await native_fleet.provider.admin(native_fleet.workers["vllm-0"]).is_paused()


async def test_probe_agrees_with_transformers_at_v0(native_fleet, base_weights, probe):
    results = await probe_fleet(native_fleet, base_weights, probe)
    assert {r.worker_id for r in results} == {"vllm-0", "vllm-1"}
    for r in results:
        assert r.max_abs_diff < 2e-3, r


@pytest.mark.parametrize("kind, versions", [("broadcast", (1, 2)), ("filesystem", (3, 4))])
async def test_publish_two_versions(native_fleet, base_weights, probe, tmp_path_factory, kind, versions):
    transport = make_transport(kind, host="127.0.0.1", bucket_bytes=32 << 20,
                               storage_dir=tmp_path_factory.mktemp(f"weights-{kind}"))
    try:
        for version in versions:
            weights = perturbed(base_weights, seed=version)
            report = await native_fleet.publish(version, transport, weights)
            assert sorted(report.ready) == ["vllm-0", "vllm-1"] and not report.failed, report
            assert native_fleet.version == version
            for worker in native_fleet.workers.values():
                admin = native_fleet.provider.admin(worker)
                assert worker.state == WorkerState.READY and worker.version == version
                assert await admin.version() == version
                assert await admin.collective_rpc("fleetrl_weight_checksum") == [report.checksum]
            # The served weights are the published ones, not merely labelled so.
            expected = model_with(base_weights, weights)
            for r in await probe_fleet(native_fleet, expected, probe):
                assert r.max_abs_diff < 2e-3, r
            for r in await probe_fleet(native_fleet, base_weights, probe):
                assert r.mean_abs_diff > 0.05, r
    finally:
        await transport.close()


async def test_span_boundary_is_exactly_where_the_weights_changed(native_fleet, base_weights, tokenizer,
                                                                  tmp_path_factory):
    await check_keep_mode_span_boundary(native_fleet, base_weights, tokenizer, tmp_path_factory.mktemp("weights-span"),
                                        "broadcast")


async def test_abort_mode_continues_and_joins_spans(native_fleet, base_weights, tokenizer, tmp_path_factory):
    await check_abort_mode_joins_spans(native_fleet, base_weights, tokenizer, tmp_path_factory.mktemp("weights-abort"),
                                       "filesystem")


async def test_worker_killed_mid_publish_leaves_survivor_serving_one_version(native_fleet, base_weights,
                                                                             tokenizer, tmp_path_factory):
    """Runs last: it kills vllm-1."""
    old = native_fleet.version
    transport = make_transport("broadcast", host="127.0.0.1", bucket_bytes=4 << 20,
                               storage_dir=tmp_path_factory.mktemp("weights-kill"))
    weights = perturbed(base_weights, seed=old + 1)

    def killing_weights():
        for i, item in enumerate(weights()):
            if i == 20:  # mid-transfer
                native_fleet.provider.stop_worker("vllm-1")
            yield item

    try:
        report = await native_fleet.publish(old + 1, transport, killing_weights)
    finally:
        await transport.close()
    assert report.ready == ["vllm-0"], report
    assert "vllm-1" in report.failed and report.failed["vllm-1"], report
    assert native_fleet.workers["vllm-1"].state in (WorkerState.DEAD, WorkerState.STALE)
    assert native_fleet.workers["vllm-0"].state == WorkerState.READY
    prompt = chat_ids(tokenizer, "Say hello.")
    outs = await asyncio.gather(*(greedy_response(native_fleet, prompt, 8) for _ in range(4)))
    assert {o.worker_id for o in outs} == {"vllm-0"}
    assert all(o.spans == [VersionSpan(old + 1, 0)] for o in outs)
    await native_fleet.refresh()
    assert native_fleet.workers["vllm-1"].state == WorkerState.DEAD
