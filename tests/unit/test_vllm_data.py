"""The native data plane's reading of a worker's answer (fleetrl/inference/vllm/data.py): an
answer that cannot be a sample is the worker's error, which the fleet sends again elsewhere."""

import httpx
import pytest

from fleetrl.errors import FleetrlError
from fleetrl.inference.types import GenerateRequest, SamplingParams
from fleetrl.inference.vllm.data import VllmDataClient

CHOICE = {"token_ids": [5, 6, 7], "finish_reason": "length",
          "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}, {"logprob": -1.0}]},
          "weight_versions": [{"version": "v2@r1", "start": 0, "end": 3}]}


async def answer(choice: dict):
    client = VllmDataClient("data-token", 30, "r1")
    await client.close()
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda request: httpx.Response(200, json={"choices": [choice]})))
    try:
        return await client.generate("vllm-0", "http://worker", GenerateRequest([1, 2], SamplingParams(max_tokens=3)))
    finally:
        await client.close()


async def test_a_whole_answer_is_a_completion():
    (out,) = await answer(CHOICE)
    assert out.token_ids == [5, 6, 7] and out.logprobs == [-0.5, -0.25, -1.0] and out.finish_reason == "length"


@pytest.mark.parametrize("change, error", [
    ({"finish_reason": None}, r"a completion without a finish_reason"),
    ({"logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}, r"2 logprobs for 3 tokens"),
])
async def test_an_answer_that_cannot_be_a_sample_is_the_workers_error(change, error):
    """No finish_reason was read as "abort" and the completion continued; logprobs short of the
    tokens shifted every later token's ratio in the loss."""
    with pytest.raises(FleetrlError, match=rf"^worker vllm-0: generate \w+: {error}$"):
        await answer({**CHOICE, **change})
