"""fleetrl's Dynamo worker kind (`inference.dynamo_worker = "fleetrl"`): Dynamo's own vLLM
worker plus per-token versions, behind a real frontend. The same per-token checks as the
native provider's, in keep and abort mode."""

import pytest
import pytest_asyncio

from fleetrl.config import InferenceConfig
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import GenerateRequest, SamplingParams
from fleetrl.versions import VersionSpan

from .conftest import chat_ids, check_abort_mode_joins_spans, check_keep_mode_span_boundary, running

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def token_fleet(model_dir, tmp_path_factory):
    """Frontend + 1 worker of fleetrl's kind, keep mode (the default for that kind)."""
    config = InferenceConfig(provider="dynamo", dynamo_worker="fleetrl", workers=1, max_model_len=512,
                             admin_timeout_s=120, startup_timeout_s=900)
    provider = DynamoProvider(config, model_dir, tmp_path_factory.mktemp("dynamo-run"))
    async with running(Fleet(provider, pause_mode=config.resolved_pause_mode(),
                             discovery_interval_s=3600)) as fleet:
        yield fleet


async def test_worker_reports_per_token_versions(token_fleet, tokenizer):
    (worker,) = token_fleet.workers.values()
    admin = token_fleet.provider.admin(worker)
    assert await admin.reports_token_versions()
    assert token_fleet.pause_mode == "keep"
    outs = await token_fleet.generate(GenerateRequest(chat_ids(tokenizer, "Name a fish."),
                                                      SamplingParams(max_tokens=8, seed=1), n=2))
    for out in outs:
        assert out.spans == [VersionSpan(0, 0)] and 0 < len(out.token_ids) == len(out.logprobs)


async def test_keep_mode_span_boundary_is_where_the_weights_changed(token_fleet, base_weights, tokenizer,
                                                                    tmp_path_factory):
    await check_keep_mode_span_boundary(token_fleet, base_weights, tokenizer, tmp_path_factory.mktemp("w-keep"),
                                        "broadcast")


async def test_abort_mode_continues_and_joins_spans(token_fleet, base_weights, tokenizer, tmp_path_factory):
    await check_abort_mode_joins_spans(token_fleet, base_weights, tokenizer, tmp_path_factory.mktemp("w-abort"),
                                       "filesystem")

