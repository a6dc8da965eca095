"""Weight transfer into a real vLLM CPU server, through each transport.

One server for the module: the first of the operator-started pair that test_kill_points.py
attaches to next (deployments.py), brought to the base weights first, whatever it served
before (`model_dir` and `tokenizer` come from conftest.py). A publish swaps two rows of the
(tied) embedding: a model whose token ids A and B trade places must produce the original
greedy completion with A and B traded, which checks that every layer, the tied LM head
included, took the new weights.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fleetrl.contract import WEIGHT_STATE_METHOD, WEIGHT_UPDATE_PHASES, WEIGHT_UPDATE_SERIAL_PHASES
from fleetrl.inference.http import RunClaim
from fleetrl.inference.provider import WeightTransport
from fleetrl.inference.vllm.admin import VllmAdminRoutes, VllmWorkerControl
from fleetrl.inference.vllm.weight_sync import VllmWeightSync
from fleetrl.weights.filesystem import manifest
from fleetrl.weights.factory import make_transport

from .deployments import ADMIN, OPERATOR_SERVERS

# The run these tests publish as: the labels they set carry it (versions.version_label).
RUN = "weighttransfer"

pytestmark = [pytest.mark.integration, pytest.mark.deployment(OPERATOR_SERVERS)]

PROMPT = "The capital of France is"
MAX_TOKENS = 8
EMBEDDINGS = "model.embed_tokens.weight"

Weights = list[tuple[str, torch.Tensor]]


@pytest.fixture(scope="module")
def server(operator_servers, original, tmp_path_factory) -> str:
    """The first operator-started server's URL, holding the base weights (published as v100:
    a shared server may hold what its last user left)."""
    url = operator_servers[0]

    async def restore(client: VllmWorkerControl) -> None:
        transport = make_transport("filesystem", host="127.0.0.1", bucket_bytes=64 << 20,
                                   storage_dir=tmp_path_factory.mktemp("base"))
        try:
            await publish(client, transport, original, 100)
        finally:
            await transport.close()

    asyncio.run(with_client(url, restore))
    return url


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def original(model_dir) -> Weights:
    return list(load_file(str(model_dir / "model.safetensors")).items())


@pytest.fixture(scope="module")
def original_output(server, prompt_ids) -> list[int]:
    return asyncio.run(with_client(server, lambda c: generate(c, prompt_ids)))


@pytest.fixture(scope="module")
def swap(original_output, prompt_ids) -> tuple[int, int]:
    """A: the first generated token not in the prompt; B: a token in neither."""
    a = next(t for t in original_output if t not in prompt_ids)
    b = next(t for t in range(1000, 2000) if t not in prompt_ids and t not in original_output)
    return a, b


@pytest.fixture(scope="module")
def modified(original, swap) -> Weights:
    a, b = swap
    weights = []
    for name, tensor in original:
        if name == EMBEDDINGS:
            tensor = tensor.clone()
            tensor[[a, b]] = tensor[[b, a]]
        weights.append((name, tensor))
    return weights


@pytest.fixture(scope="module")
def expected_output(original_output, swap, model_dir, modified, prompt_ids) -> list[int]:
    a, b = swap
    expected = [{a: b, b: a}.get(t, t) for t in original_output]
    assert expected != original_output
    assert hf_greedy(model_dir, modified, prompt_ids) == expected  # transformers fp32 agrees
    return expected


def hf_greedy(model_dir: Path, weights: Weights, prompt_ids: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(dict(weights), strict=False)  # lm_head.weight is tied, not stored
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


async def with_client(url: str, body):
    client = VllmWorkerControl(VllmAdminRoutes("worker-0", url, ADMIN, timeout_s=120, retries=2,
                                               claim=RunClaim(RUN, 30)))
    try:
        return await body(client)
    finally:
        await client.close()


async def generate(client: VllmWorkerControl, prompt_ids: list[int]) -> list[int]:
    response = await client.routes.call("POST", "/inference/v1/generate", idempotent=False, json={
        "token_ids": prompt_ids,
        "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0},
    })
    return response["choices"][0]["token_ids"]


async def publish(client: VllmWorkerControl, transport: WeightTransport, weights: Weights,
                  version: int) -> None:
    """pause -> transfer -> checks while paused -> resume."""
    await client.pause("keep")
    try:
        started, wall = time.monotonic(), time.time()
        checksum = await transport.transfer([VllmWeightSync(client.routes)], lambda: iter(weights), version)
        seconds = time.monotonic() - started
        assert await client.version() == version
        (state,) = await client.routes.collective_rpc(WEIGHT_STATE_METHOD)
        assert state["checksum"] == checksum and state["received_at"] >= wall and not state["updating"]
        # The receiver's profile of this update (the publish breakdown of docs/benchmarks.md).
        assert list(state["phases"]) == list(WEIGHT_UPDATE_PHASES), state["phases"]
        phases = state["phases"]
        assert phases["receive"] > 0 and phases["hash"] > 0 and phases["load"] > 0
        # Hash and load run on the rank's pipeline threads, beside the receive; the phases on
        # its own thread add up to at most the transfer, and so does each pipeline stage.
        assert sum(phases[p] for p in WEIGHT_UPDATE_SERIAL_PHASES) <= seconds
        assert phases["hash"] <= seconds and phases["load"] <= seconds
        assert await client.in_flight() == 0  # vLLM's own gauges, read from its /metrics
    finally:
        await client.resume()
    print(f"{transport.name}: v{version} published in {seconds:.2f} s")


def test_broadcast_publishes_and_restores(server, tmp_path, prompt_ids, original, modified,
                                          original_output, expected_output):
    async def scenario(client: VllmWorkerControl) -> None:
        transport = make_transport("broadcast", host="127.0.0.1", bucket_bytes=32 << 20, storage_dir=tmp_path)
        try:
            await publish(client, transport, modified, 101)
            assert await generate(client, prompt_ids) == expected_output
            group = (await client.routes.collective_rpc("fleetrl_broadcast_group"))[0]
            assert group

            await publish(client, transport, original, 102)
            assert await generate(client, prompt_ids) == original_output
            # Same workers, all in the group: the group is reused.
            assert (await client.routes.collective_rpc("fleetrl_broadcast_group"))[0] == group

            # A worker that left the group (as after a restart) makes the sender re-form it.
            await client.routes.call("POST", "/shutdown_weight_transfer_engine", idempotent=False)
            await publish(client, transport, modified, 103)
            assert (await client.routes.collective_rpc("fleetrl_broadcast_group"))[0] not in ("", group)
            assert await generate(client, prompt_ids) == expected_output
            await publish(client, transport, original, 104)
        finally:
            await transport.close()

    asyncio.run(with_client(server, scenario))


def test_filesystem_publishes_and_restores(server, tmp_path, prompt_ids, original, modified,
                                           original_output, expected_output):
    async def scenario(client: VllmWorkerControl) -> None:
        transport = make_transport("filesystem", host="127.0.0.1", bucket_bytes=64 << 20, storage_dir=tmp_path)
        await publish(client, transport, modified, 201)
        assert await generate(client, prompt_ids) == expected_output
        await publish(client, transport, original, 202)
        assert await generate(client, prompt_ids) == original_output
        await publish(client, transport, original, 203)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["v202", "v203"]  # the last two kept
        await transport.close()

    asyncio.run(with_client(server, scenario))


def test_shm_publishes_and_restores(server, tmp_path, prompt_ids, original, modified, original_output, expected_output):
    """The shared-memory transport, which no code outside its package and its registry line
    names, moves the weights into a real worker on this host."""
    async def scenario(client: VllmWorkerControl) -> None:
        transport = make_transport("shm", host="127.0.0.1", bucket_bytes=32 << 20, storage_dir=tmp_path)
        try:
            await publish(client, transport, modified, 401)
            assert await generate(client, prompt_ids) == expected_output
            await publish(client, transport, original, 402)
            assert await generate(client, prompt_ids) == original_output
        finally:
            await transport.close()

    asyncio.run(with_client(server, scenario))


def test_filesystem_refuses_an_unready_version(server, tmp_path, prompt_ids, original, modified,
                                               original_output, monkeypatch):
    """A version without its READY marker is refused before anything loads: the worker keeps
    its weights, drops its checksum and carries a label that names no version."""
    write_version = manifest.write_version

    def write_without_ready(*args, **kwargs):
        written = write_version(*args, **kwargs)
        (written.folder / manifest.READY).unlink()
        return written

    monkeypatch.setattr("fleetrl.weights.filesystem.sender.write_version", write_without_ready)

    async def scenario(client: VllmWorkerControl) -> None:
        transport = make_transport("filesystem", host="127.0.0.1", bucket_bytes=64 << 20, storage_dir=tmp_path)
        await client.pause("keep")
        try:
            with pytest.raises(Exception, match="v301/READY is missing"):
                await transport.transfer([VllmWeightSync(client.routes)], lambda: iter(modified), 301)
            assert await client.version() is None
            info = await client.routes.call("GET", "/weight_info", idempotent=True)
            assert info["weight_version"] == f"incomplete-v301@{RUN}"
            assert [s["checksum"] for s in await client.routes.collective_rpc(WEIGHT_STATE_METHOD)] == [None]
        finally:
            await client.resume()
        assert await generate(client, prompt_ids) == original_output

    asyncio.run(with_client(server, scenario))
