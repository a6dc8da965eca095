"""Deadlines of calls to workers (fleetrl/inference/http.py): a whole answer within the timeout,
not each read within it. A real socket trickles the answer a byte at a time: to an admin call, a
data request, a Dynamo frontend's worker listing, and an attached server's checks at start."""

import asyncio

import pytest

from fleetrl.config import DynamoConfig, InferenceConfig
from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.http import SINGLE_TRY, AdminHttp
from fleetrl.inference.types import GenerateRequest, SamplingParams
from fleetrl.inference.vllm.data import VllmDataClient
from fleetrl.inference.vllm.provider import VllmProvider

BODY = b'{"choices": []}'  # a whole answer (no completion), 15 bytes
# A whole answer that takes a minute to trickle: past the test's own bound on a wait without one.
SLOW_BODY = b" " * 300 + b"{}"


async def trickling_server(body: bytes = BODY):
    """A worker that answers at once, then sends its body a byte every 0.2 s (BODY: 3 s in all,
    each read well within a 1 s timeout, the whole past it)."""
    async def answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        try:
            for byte in body:
                if reader.at_eof():  # the caller gave up
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)
        except ConnectionError:
            pass
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_an_admin_call_that_trickles_past_its_timeout_fails():
    server, url = await trickling_server()
    admin = AdminHttp("w", url, timeout_s=1.0, retries=0)
    try:
        with pytest.raises(FleetrlError, match=r"^worker w: GET /version failed: ReadTimeout talking to http://127.0.0.1:\d+$"):
            await admin.call("GET", "/version", idempotent=True)
    finally:
        await admin.close()
        server.close()


async def test_a_generate_that_trickles_past_its_timeout_fails():
    server, url = await trickling_server()
    data = VllmDataClient("token", timeout_s=1.0, run="r1")
    try:
        with pytest.raises(FleetrlError, match=r"^worker w: generate \w+ failed: ReadTimeout talking to"):
            await data.generate("w", url, GenerateRequest([1, 2], SamplingParams(max_tokens=1)))
    finally:
        await data.close()
        server.close()


async def test_in_a_discovery_round_an_admin_call_is_tried_once():
    """Under the publish fence (the fleet's discovery task sets SINGLE_TRY), a worker that does
    not answer holds a waiting publish back for one timeout, not admin_retries + 1 of them."""
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)  # accepts, never answers
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    admin = AdminHttp("w", url, timeout_s=0.2, retries=2)
    sent = []
    send = admin._http.send

    async def counted(request, **kwargs):
        sent.append(request.url.path)
        return await send(request, **kwargs)

    admin._http.send = counted
    try:
        for single_try, tries in ((False, 3), (True, 1)):
            sent.clear()
            token = SINGLE_TRY.set(single_try)
            try:
                with pytest.raises(FleetrlError, match="ReadTimeout"):
                    await admin.call("POST", "/pause", idempotent=True)
            finally:
                SINGLE_TRY.reset(token)
            assert sent == ["/pause"] * tries
    finally:
        await admin.close()
        server.close()


async def test_a_dynamo_worker_listing_that_trickles_past_its_timeout_fails_the_discovery_round(tmp_path):
    """A frontend that accepts the listing's request and trickles its answer held the discovery
    round (and a Dynamo fleet's start) for as long as it trickled (issue 36, item 9)."""
    server, url = await trickling_server(SLOW_BODY)
    config = InferenceConfig(provider="dynamo", admin_timeout_s=1.0,
                             dynamo=DynamoConfig(frontend_url="http://127.0.0.1:9", rl_url=url))
    provider = DynamoProvider(config, tmp_path, tmp_path, None, log=lambda line: None)
    try:
        with pytest.raises(FleetrlError, match=r"^Dynamo RL discovery at http://127.0.0.1:\d+/v1/rl/workers failed: "
                                               r"ReadTimeout: no whole answer within 1 s$"):
            await asyncio.wait_for(provider.discover(), 30)
    finally:
        await provider.close()
        server.close()


async def test_an_attached_server_that_trickles_its_answers_is_refused_within_the_admin_timeout(tmp_path):
    """The checks of an attached server at start (health, admin and data routes) each get a
    whole answer within inference.admin_timeout_s: a trickling server held the start (issue 36,
    item 9)."""
    server, url = await trickling_server(SLOW_BODY)
    provider = VllmProvider(InferenceConfig(urls=[url], admin_timeout_s=1.0), None, tmp_path, "admin-token",
                            "data-token", "r1", log=lambda line: None)
    try:
        with pytest.raises(FleetrlError, match=rf"^inference.urls: no whole answer from {url}/health within 1 s "
                                               r"\(inference.admin_timeout_s\)$"):
            await asyncio.wait_for(provider.start(), 30)
    finally:
        await provider.close()
        server.close()
