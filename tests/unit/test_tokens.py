"""The native workers' two tokens: which routes each opens, where they come from, how they
reach launched servers (environment only), how a run records them, and what an attached
server must prove before the fleet uses it."""

import os
import stat

import httpx
import pytest

from fleetrl import admin_signature
from fleetrl.app.providers import Tokens, attached_to_run, resolve_tokens, start_recorded
from fleetrl.config import Config, ConfigError, DynamoConfig, InferenceConfig
from fleetrl.contract import ADMIN_AUTHORITIES_ENV, ADMIN_TOKEN_ENV, DATA_TOKEN_ENV, INSTANCE_PATH, STALE_INSTANCE
from fleetrl.engine.admin_auth import AdminTokenMiddleware
from fleetrl.errors import FleetrlError
from fleetrl.inference.http import AdminHttp, RunClaim
from fleetrl.inference.provider import ImpostorWorker
from fleetrl.inference.vllm import launcher
from fleetrl.inference.vllm.admin import VllmAdminRoutes, VllmWorkerControl
from fleetrl.inference.vllm.provider import VllmProvider
from fleetrl.rundir import RunDir

from .asgi_server import answering, serving

ADMIN, DATA = "admin-secret", "data-secret"


@pytest.fixture(autouse=True)
def no_tokens_in_the_environment(monkeypatch):
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.delenv(DATA_TOKEN_ENV, raising=False)


@pytest.fixture
def guarded(monkeypatch):
    """A server behind fleetrl's middleware, started with ADMIN and DATA (as a launched one is)."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, DATA)
    with serving(AdminTokenMiddleware(answering({"is_paused": False}))) as url:
        yield url


def bearer(token):
    return {"Authorization": f"Bearer {token}"} if token else {}


# -- which routes each token opens --------------------------------------------------------------

ADMIN_ROUTES = [("POST", "/pause"), ("POST", "/update_weights"), ("POST", "/collective_rpc"),
                ("GET", "/weight_info"), ("POST", "/update_weight_version"), ("POST", "/v1/load_lora_adapter"),
                ("POST", "/inference/v1/abort_requests"), ("GET", "/v1/completionsX")]
DATA_ROUTES = [("POST", "/inference/v1/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
               ("GET", "/v1/models"), ("GET", "/v1/responses/abc")]


@pytest.mark.parametrize("method, path", ADMIN_ROUTES + DATA_ROUTES)
def test_no_token_or_a_wrong_one_opens_nothing_but_the_probes(guarded, method, path):
    for headers in ({}, bearer("wrong"), {"Authorization": f"Basic {ADMIN}"}):
        assert httpx.request(method, guarded + path, headers=headers).status_code == 401, (path, headers)
    assert httpx.get(guarded + "/health").status_code == 200
    assert httpx.get(guarded + "/ping").status_code == 200


@pytest.mark.parametrize("method, path", ADMIN_ROUTES)
def test_admin_routes_take_the_admin_token_only(guarded, method, path):
    assert httpx.request(method, guarded + path, headers=bearer(DATA)).status_code == 401
    assert httpx.request(method, guarded + path, headers=bearer(ADMIN)).status_code == 200


@pytest.mark.parametrize("method, path", DATA_ROUTES)
def test_data_routes_take_the_data_token_and_the_admin_token(guarded, method, path):
    assert httpx.request(method, guarded + path, headers=bearer(DATA)).status_code == 200
    assert httpx.request(method, guarded + path, headers=bearer(ADMIN)).status_code == 200


# -- signed admin calls: the admin token never crosses the wire from fleetrl ----------------------

def authority_of(url: str) -> str:
    return url.removeprefix("http://")


def instance_of(url: str) -> str:
    """The instance the server at `url` announces to anyone."""
    return httpx.get(url + INSTANCE_PATH).json()["instance"]


def signed(token: str, method: str, url: str, target: str, body: bytes = b"", authority: str | None = None,
           instance: str | None = None) -> tuple[dict, str]:
    """The headers of a call signed as fleetrl signs one, to the server at `url` (or naming
    `authority` as the address called) for the instance it announces (or `instance`), and the
    nonce its proof is made of."""
    call = admin_signature.SignedCall(method, target, authority or authority_of(url), body,
                                      instance or instance_of(url))
    value, nonce = admin_signature.authorization(token, call)
    return {"Authorization": value, **({"Host": authority} if authority else {})}, nonce


def proven(answer: httpx.Response, nonce: str, url: str, token: str = ADMIN, data: bool = False) -> bool:
    """Whether `answer` carries the proof of its very body by the server at `url`, for the call
    with `nonce` (`data`: a data request's, which names no instance)."""
    expected = admin_signature.answer_proof(token, nonce, authority_of(url), "" if data else instance_of(url),
                                            answer.content)
    return admin_signature.proves(expected, answer.headers.get(admin_signature.PROOF_HEADER))


def test_a_signed_call_opens_the_admin_routes_once_and_its_answer_proves_the_worker_holds_the_token(guarded):
    headers, nonce = signed(ADMIN, "POST", guarded, "/pause?mode=keep")
    answer = httpx.post(guarded + "/pause?mode=keep", headers=headers)
    assert answer.status_code == 200 and proven(answer, nonce, guarded)
    assert not proven(answer, nonce, guarded, token="other")
    # Replayed (by whoever saw it), the same signature opens nothing.
    assert httpx.post(guarded + "/pause?mode=keep", headers=headers).status_code == 401


@pytest.mark.parametrize("case", ["other token", "other path", "other query", "other method", "stale", "data token",
                                  "other body", "other authority"])
def test_a_signed_call_that_is_not_the_admin_tokens_for_this_very_call_is_refused(guarded, case, monkeypatch):
    token, method, target = {"other token": "wrong", "data token": DATA}.get(case, ADMIN), "POST", "/pause?mode=keep"
    with monkeypatch.context() as clock:
        if case == "stale":  # signed 301 s ago
            now = admin_signature.time.time()
            clock.setattr(admin_signature.time, "time", lambda: now - admin_signature.MAX_SKEW_S - 1)
        headers, _ = signed(token, {"other method": "GET"}.get(case, method), guarded,
                            {"other path": "/resume", "other query": "/pause?mode=abort"}.get(case, target),
                            body=b'{"mode": "keep"}',
                            authority="127.0.0.1:1" if case == "other authority" else None)
    if case == "other authority":
        headers.pop("Host")  # signed for another worker's address, sent to this one
    answer = httpx.post(guarded + target, headers=headers,
                        content=b'{"mode": "abort"}' if case == "other body" else b'{"mode": "keep"}')
    assert answer.status_code == 401 and admin_signature.PROOF_HEADER not in answer.headers


async def test_a_call_captured_before_a_restart_opens_nothing_after_it_and_the_run_signs_anew(monkeypatch):
    """The legitimate server, restarted at the same port within MAX_SKEW_S, has forgotten the
    nonces it let in; its new instance refuses what was signed for the old one (issue 36, item 5)."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, DATA)
    server = [AdminTokenMiddleware(answering({"is_paused": False, "weight_version": "v1@r1"}))]

    async def port(scope, receive, send):  # whichever start of the server listens there
        await server[0](scope, receive, send)

    with serving(port) as url:
        admin = VllmWorkerControl(VllmAdminRoutes("vllm-0", url, ADMIN, timeout_s=5, retries=0, claim=None))
        try:
            captured, _ = signed(ADMIN, "POST", url, "/pause?mode=keep")
            assert httpx.post(url + "/pause?mode=keep", headers=captured).status_code == 200
            assert await admin.version() == 1
            server[0] = AdminTokenMiddleware(answering({"is_paused": False, "weight_version": "v1@r1"}))  # restarted
            replayed = httpx.post(url + "/pause?mode=keep", headers=captured)
            assert replayed.status_code == 401 and replayed.json() == {"error": STALE_INSTANCE}
            assert await admin.version() == 1  # refused as stale once, then signed for the new instance
        finally:
            await admin.close()


async def test_a_server_of_several_api_processes_lets_a_captured_call_in_at_one_at_most(monkeypatch):
    """vLLM's --api-server-count N runs N processes behind one port, each with its own memory of
    nonces: a call let in by one was let in again by each other. Each is an instance of its own
    now, so the others refuse it; fleetrl's own client, refused as stale again after it asked
    for the instance anew, says why (the launcher refuses the flag: unit/test_config.py)."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, DATA)
    processes = [AdminTokenMiddleware(answering({"is_paused": False})) for _ in range(2)]
    turn = iter(range(10**6))

    async def port(scope, receive, send):  # the kernel hands each connection to one process
        await processes[next(turn) % 2](scope, receive, send)

    with serving(port) as url:
        call = admin_signature.SignedCall("POST", "/pause", authority_of(url), b"", processes[0].instance)
        captured = {"Authorization": admin_signature.authorization(ADMIN, call)[0]}
        assert [httpx.post(url + "/pause", headers=captured).status_code for _ in range(2)] == [200, 401]
        admin = AdminHttp("vllm-0", url, timeout_s=5, retries=0, admin_token=ADMIN)
        try:
            with pytest.raises(FleetrlError, match="stale instance.*again after it named its instance anew.*"
                                                   "--api-server-count"):
                await admin.call("GET", "/is_paused", idempotent=True)
        finally:
            await admin.close()


def rewriting(app, rewrite):
    """`app` behind a proxy that rewrites each answer's body with `rewrite` (headers kept)."""
    async def proxy(scope, receive, send):
        async def rewritten(message):
            if message["type"] == "http.response.body":
                message = {**message, "body": rewrite(message.get("body", b""))}
            elif message["type"] == "http.response.start":  # the length the rewritten body has
                message = {**message, "headers": [(k, v) for k, v in message["headers"] if k != b"content-length"]}
            await send(message)
        await app(scope, receive, rewritten)
    return proxy


@pytest.mark.parametrize("rewritten", ["version label", "checksum"])
async def test_an_answer_rewritten_on_its_way_proves_nothing(rewritten, monkeypatch):
    """A proxy between the run and the real server rewrites the label it reports, or its ranks'
    checksum into the one the sender expects: the proof covers the answer, so neither is believed."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, DATA)
    server = AdminTokenMiddleware(answering({"weight_version": "v1@r1", "results": [{"checksum": "c" * 64}]}))
    labels_or_checksums = {"version label": (b"v1@r1", b"v7@r1"), "checksum": (b"c" * 64, b"e" * 64)}[rewritten]
    with serving(rewriting(server, lambda body: body.replace(*labels_or_checksums))) as url:
        admin = VllmWorkerControl(VllmAdminRoutes("vllm-0", url, ADMIN, timeout_s=5, retries=0, claim=None))
        try:
            with pytest.raises(ImpostorWorker, match="without proof .* or the answer was changed on its way"):
                await (admin.version() if rewritten == "version label" else admin.verify_weights("e" * 64))
        finally:
            await admin.close()


async def test_a_data_answer_rewritten_on_its_way_proves_nothing(monkeypatch):
    """A relay without the run's token between the data client and the real server relabels
    the answer's version (v1 to v2 of this run) or rewrites a logprob: the data answer's proof
    covers its very body, as an admin answer's does, so the sample is an impostor's, never
    kept (issue 36, item 5)."""
    from fleetrl.inference.types import GenerateRequest, SamplingParams
    from fleetrl.inference.vllm.data import VllmDataClient

    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, DATA)
    run = "a1a1a1a1a1a1a1a1"
    server = AdminTokenMiddleware(answering({"choices": [{
        "token_ids": [5, 6], "finish_reason": "stop", "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.7}]},
        "weight_versions": [{"version": f"v1@{run}", "start": 0, "end": 2}]}]}))
    for rewrite in (lambda body: body, lambda body: body.replace(b"v1@", b"v2@"),
                    lambda body: body.replace(b"-0.5", b"-0.0")):
        with serving(rewriting(server, rewrite)) as url:
            data = VllmDataClient(DATA, 5, run, admin_token=ADMIN, vocab_size=100)
            try:
                request = GenerateRequest([1, 2], SamplingParams(max_tokens=2), request_id="r1")
                if rewrite(b"v1@-0.5") == b"v1@-0.5":  # passed on as it is: the sample is kept
                    (sample,) = await data.generate("vllm-0", url, request)
                    assert sample.answer_error is None and sample.logprobs == [-0.5, -0.7]
                else:
                    with pytest.raises(ImpostorWorker, match="vllm-0: generate r1 failed: .*changed on its way"):
                        await data.generate("vllm-0", url, request)
            finally:
                await data.close()


def relayed_to(server, own: tuple[str, int]):
    """`server` as a pod of a cluster sees what reaches it: its socket's address is `own`, the
    Host header whatever the caller (or a relay passing the call on) wrote."""
    async def at(scope, receive, send):
        await server(scope | {"server": own}, receive, send)
    return at


@pytest.mark.parametrize("addressed, let_in", [("10.0.0.2:8000", True), ("10.0.0.1:8000", False)])
async def test_a_call_relayed_from_a_dead_workers_address_on_the_same_port_is_refused(addressed, let_in, monkeypatch):
    """Every pod of a cluster serves on 8000: an impostor on dead worker A's address
    (10.0.0.1:8000) relays fleetrl's signed call to live worker B (10.0.0.2:8000). B lets in
    only calls addressed to itself, not any host at its port, so fleetrl never takes B's proven
    answers for A's (issue 36, item 5)."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, DATA)
    worker_b = relayed_to(AdminTokenMiddleware(answering({"is_paused": False})), ("10.0.0.2", 8000))
    admin = AdminHttp("A", f"http://{addressed}", 5.0, 0, admin_token=ADMIN, claim=RunClaim("a1a1a1a1a1a1a1a1", 60))
    admin._http = httpx.AsyncClient(base_url=f"http://{addressed}", transport=httpx.ASGITransport(app=worker_b))
    try:
        if let_in:
            assert (await admin.call("GET", "/is_paused", idempotent=True)).json() == {"is_paused": False}
        else:
            with pytest.raises(FleetrlError, match="the admin token was refused .*signed for 10.0.0.1:8000, which is "
                                                   "not an address of this server .*10.0.0.2:8000.*"
                                                   + ADMIN_AUTHORITIES_ENV):
                await admin.call("GET", "/is_paused", idempotent=True)
        nonce = admin_signature.fresh_nonce()
        answer = await admin._http.post("/inference/v1/generate",
                                        headers={**bearer(DATA), admin_signature.NONCE_HEADER: nonce})
        assert (admin_signature.PROOF_HEADER in answer.headers) == let_in
    finally:
        await admin.close()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
async def test_a_loopback_server_is_reached_by_any_loopback_name_of_its_port(guarded, host):
    """Attached as http://localhost:P or http://127.0.0.1:P: one server, let in either way."""
    url = guarded.replace("127.0.0.1", host)
    admin = AdminHttp("vllm-0", url, timeout_s=5, retries=0, admin_token=ADMIN)
    try:
        assert (await admin.call("GET", "/is_paused", idempotent=True)).json() == {"is_paused": False}
    finally:
        await admin.close()


def test_a_call_relayed_from_another_address_is_refused_there(guarded):
    """A process on a dead worker's port (here 127.0.0.1:1) passes fleetrl's signed call, and a
    data request naming a nonce, on to a live worker: the worker lets in, and proves, only what
    was addressed to it, so the relay gets no proof to hand back (issue 27, item 6)."""
    headers, _ = signed(ADMIN, "GET", guarded, "/is_paused", authority="127.0.0.1:1")  # Host: the dead port
    answer = httpx.get(guarded + "/is_paused", headers=headers)
    assert answer.status_code == 401 and admin_signature.PROOF_HEADER not in answer.headers
    nonce = admin_signature.fresh_nonce()
    answer = httpx.post(guarded + "/inference/v1/generate",
                        headers={**bearer(DATA), "x-fleetrl-nonce": nonce, "Host": "127.0.0.1:1"})
    assert admin_signature.PROOF_HEADER not in answer.headers


async def test_a_port_mapped_address_is_let_in_once_the_server_is_told_of_it(monkeypatch):
    """Behind a Service that maps port 80 to the server's own, callers address http://svc (an
    HTTP client sends `Host: svc`, leaving the default port out): fleetrl's own client, through
    a transport that sends what it addresses to the server, is let in once svc:80 is listed."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, DATA)
    for listed in (False, True):
        if listed:
            monkeypatch.setenv(ADMIN_AUTHORITIES_ENV, "other:81, svc:80")
        with serving(AdminTokenMiddleware(answering({"is_paused": False}))) as url:
            admin = AdminHttp("w", "http://svc", timeout_s=5, retries=0, admin_token=ADMIN)
            forward = httpx.AsyncHTTPTransport()

            class ToTheServer(httpx.AsyncBaseTransport):  # the Service: svc:80 -> the server's own port
                async def handle_async_request(self, request):
                    request.url = request.url.copy_with(host="127.0.0.1", port=int(url.rsplit(":", 1)[1]))
                    return await forward.handle_async_request(request)

            admin._http = httpx.AsyncClient(base_url="http://svc", transport=ToTheServer())
            try:
                if listed:
                    assert (await admin.call("GET", "/is_paused", idempotent=True)).json() == {"is_paused": False}
                else:
                    with pytest.raises(FleetrlError, match="the admin token was refused"):
                        await admin.call("GET", "/is_paused", idempotent=True)
            finally:
                await admin.close()


def recording(requests: list, unauthorized_without_header: bool = False, proof: bytes | None = None):
    """A process that took a worker's port: it answers /health, names an instance (the one it
    took the place of, say), and answers every other request with 200 (or 401 with no
    Authorization header, as a middleware would), noting each request's headers; with `proof`,
    a made-up proof header."""
    async def app(scope, receive, send):
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        if scope["path"] == INSTANCE_PATH:
            return await answering({"instance": "1" * 32})(scope, receive, send)
        requests.append((scope["path"], headers))
        status = 401 if unauthorized_without_header and "authorization" not in headers and \
            scope["path"] != "/health" else 200
        answer = [(b"content-type", b"application/json")]
        if proof is not None:
            answer.append((admin_signature.PROOF_HEADER.encode(), proof))
        await send({"type": "http.response.start", "status": status, "headers": answer})
        await send({"type": "http.response.body", "body": b'{"is_paused": false, "weight_version": "v3"}'})
    return app


@pytest.mark.parametrize("proof", [None, b"0" * 64, "\u00fc".encode() * 32], ids=["none", "wrong", "not hex"])
async def test_a_process_on_a_workers_port_never_gets_the_admin_token_and_is_found_out_at_once(proof):
    """Its /health passed before; now the fleet's health check is signed too, and an answer
    without the worker's proof (none, a wrong one, one that is not even hex) is an impostor's."""
    requests: list = []
    with serving(recording(requests, proof=proof)) as url:
        admin = VllmWorkerControl(VllmAdminRoutes("vllm-0", url, ADMIN, timeout_s=5, retries=0, claim=RunClaim("r1", 30)))
        try:
            for call in (admin.health, admin.version):
                with pytest.raises(ImpostorWorker, match="vllm-0.*without proof that it holds the run's admin token"):
                    await call()
        finally:
            await admin.close()
    # The last is the client letting the worker go as it closes: signed, like the others.
    assert [path for path, _ in requests] == ["/health", "/weight_info", "/fleetrl/claim"]
    assert not any(ADMIN in value for _, headers in requests for value in headers.values()), requests


async def test_a_process_on_a_workers_port_cannot_answer_fleetrls_data_requests():
    """fleetrl's data client names a nonce with each request; an answer without the worker's
    proof of it is an impostor's, never a sample (it could label made-up tokens v(n))."""
    from fleetrl.inference.types import GenerateRequest, SamplingParams
    from fleetrl.inference.vllm.data import VllmDataClient

    requests: list = []
    with serving(recording(requests)) as url:
        data = VllmDataClient(DATA, 5, "r1", admin_token=ADMIN)
        try:
            with pytest.raises(ImpostorWorker, match="vllm-0: generate r1 failed: it answered .* without proof"):
                await data.generate("vllm-0", url, GenerateRequest([1, 2], SamplingParams(max_tokens=2), request_id="r1"))
            with pytest.raises(ImpostorWorker, match="vllm-0: scoring failed: it answered .* without proof"):
                await data.prompt_logprobs("vllm-0", url, [1, 2, 3])
        finally:
            await data.close()
    assert not any(ADMIN in value for _, headers in requests for value in headers.values()), requests


def test_a_data_request_that_names_a_nonce_gets_the_proof_of_it(guarded):
    nonce = admin_signature.fresh_nonce()
    for token in (DATA, ADMIN):
        answer = httpx.post(guarded + "/inference/v1/generate", headers={**bearer(token), "x-fleetrl-nonce": nonce})
        assert answer.status_code == 200 and proven(answer, nonce, guarded, data=True)
    # Without the data token, a nonce opens nothing and proves nothing.
    answer = httpx.post(guarded + "/inference/v1/generate", headers={"x-fleetrl-nonce": nonce})
    assert answer.status_code == 401 and admin_signature.PROOF_HEADER not in answer.headers


def test_a_signed_health_check_gets_the_proof_and_an_unsigned_one_still_passes(guarded):
    headers, nonce = signed(ADMIN, "GET", guarded, "/health")
    answer = httpx.get(guarded + "/health", headers=headers)
    assert answer.status_code == 200 and proven(answer, nonce, guarded)
    assert httpx.get(guarded + "/health").status_code == 200  # a load balancer's probe, say


def test_an_error_the_server_raises_is_answered_with_its_text_and_the_proof(monkeypatch):
    """vLLM's handler of last resort answers from outside the middleware: the caller took a
    real error ("a weight update is already active") for an impostor's answer."""
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, DATA)

    async def failing(scope, receive, send):
        raise RuntimeError("start_weight_update called while a weight update is already active")

    with serving(AdminTokenMiddleware(failing)) as url:
        headers, nonce = signed(ADMIN, "POST", url, "/collective_rpc")
        answer = httpx.post(url + "/collective_rpc", headers=headers)
        assert answer.status_code == 500 and "a weight update is already active" in answer.json()["error"]
        assert proven(answer, nonce, url)


async def test_an_attached_server_that_cannot_prove_it_holds_the_admin_token_is_refused_without_getting_it():
    requests: list = []
    with serving(recording(requests, unauthorized_without_header=True)) as url:
        with pytest.raises(FleetrlError, match=f"worker {url}: it answered \\(HTTP 200: .*\\) without proof that it "
                                               "holds the run's admin token"):
            await attach(url)
    assert not any(ADMIN in value for _, headers in requests for value in headers.values()), requests


@pytest.mark.parametrize("unset", [ADMIN_TOKEN_ENV, DATA_TOKEN_ENV])
def test_the_middleware_refuses_to_serve_without_both_tokens(monkeypatch, unset):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    monkeypatch.setenv(DATA_TOKEN_ENV, DATA)
    monkeypatch.delenv(unset)
    with pytest.raises(RuntimeError, match=f"{unset} is not set"):
        AdminTokenMiddleware(answering({}))


# -- where the tokens come from -----------------------------------------------------------------

def test_tokens_come_from_the_config_then_the_environment_then_fresh():
    env = {ADMIN_TOKEN_ENV: "env-admin", DATA_TOKEN_ENV: "env-data"}
    assert resolve_tokens(InferenceConfig(admin_token="a", data_token="d"), draw_missing=True, environ=env) == \
        Tokens("a", "d")
    assert resolve_tokens(InferenceConfig(), draw_missing=True, environ=env) == Tokens("env-admin", "env-data")
    fresh = resolve_tokens(InferenceConfig(), draw_missing=True, environ={})
    assert len(fresh.admin) >= 32 and len(fresh.data) >= 32 and fresh.admin != fresh.data
    assert resolve_tokens(InferenceConfig(), draw_missing=True, environ={}).admin != fresh.admin
    # Only attaching (fleetrl status): a fresh token would open nothing.
    assert resolve_tokens(InferenceConfig(), draw_missing=False, environ={}) == Tokens(None, None)


def test_one_token_for_both_planes_is_refused():
    with pytest.raises(ConfigError, match="the admin and data tokens are the same"):
        resolve_tokens(InferenceConfig(admin_token="same"), draw_missing=True, environ={DATA_TOKEN_ENV: "same"})


async def test_launched_servers_get_the_tokens_by_environment_never_on_the_command_line(monkeypatch, tmp_path):
    started = {}

    def start_process(name, argv, log_path, env=None, watches_parent=False, cpus=()):
        started.update(argv=argv, env=env)
        raise RuntimeError("stop here")

    monkeypatch.setattr(launcher, "start_process", start_process)
    with pytest.raises(RuntimeError, match="stop here"):
        await launcher.launch_vllm_servers(tmp_path, InferenceConfig(), 1, tmp_path, ADMIN, DATA, log=print)
    assert started["env"][ADMIN_TOKEN_ENV] == ADMIN and started["env"][DATA_TOKEN_ENV] == DATA
    # The name fleetrl calls it by is its own (inference.host may be 0.0.0.0 or a host name).
    port = started["argv"][started["argv"].index("--port") + 1]
    assert started["env"][ADMIN_AUTHORITIES_ENV] == f"{InferenceConfig().host}:{port}"
    assert not any(ADMIN in arg or DATA in arg for arg in started["argv"])


# -- what a run records for `fleetrl status RUN_DIR` --------------------------------------------

def test_the_token_file_is_created_for_this_user_alone(tmp_path):
    tmp_path = tmp_path / "run"  # not made yet: the record makes it
    old = os.umask(0)  # the mode must come from the creation itself, not from a umask
    try:
        RunDir(tmp_path).record_fleet({"provider": "vllm", "urls": ["http://h:1"]}, {"admin_token": ADMIN})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "tokens.json").stat().st_mode) == 0o600
    assert ADMIN not in (tmp_path / "fleet.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.json", "tokens.json"]  # no temporary left
    assert RunDir(tmp_path).recorded_fleet() == {"provider": "vllm", "urls": ["http://h:1"], "admin_token": ADMIN}
    RunDir(tmp_path).forget_fleet()
    assert not list(tmp_path.iterdir())


async def test_a_started_fleet_records_where_it_runs_and_its_tokens_apart(tmp_path):
    class Started:
        class provider:
            @staticmethod
            def attach_settings():
                return {"provider": "vllm", "urls": ["http://h:1"], "admin_token": ADMIN, "data_token": DATA}

        async def start(self, base):
            pass

    await start_recorded(Started(), RunDir(tmp_path), None)
    assert ADMIN not in (tmp_path / "fleet.json").read_text() and DATA not in (tmp_path / "fleet.json").read_text()
    assert RunDir(tmp_path).recorded_fleet() == Started.provider.attach_settings()


# -- what an attached server must prove ---------------------------------------------------------

async def attach(url: str, admin: str = ADMIN, data: str = DATA) -> None:
    provider = VllmProvider(InferenceConfig(urls=[url]), None, None, admin, data, "r1")
    try:
        await provider.start()
    finally:
        await provider.close()


async def test_an_attached_worker_that_obeys_admin_calls_without_a_token_is_refused():
    with serving(answering({"is_paused": False})) as url:
        with pytest.raises(FleetrlError, match=f"worker {url} accepts admin calls without a token: start it "
                                               "with fleetrl's admin middleware"):
            await attach(url)


async def test_an_attached_worker_behind_the_middleware_with_the_runs_tokens_is_accepted(guarded):
    await attach(guarded)


@pytest.mark.parametrize("admin, data, refused", [("wrong", DATA, "admin"), (ADMIN, "wrong", "data")])
async def test_an_attached_worker_that_holds_other_tokens_is_refused_naming_the_token(guarded, admin, data, refused):
    with pytest.raises(FleetrlError, match=f"worker {guarded} refused the {refused} token: set "
                                           f"inference.{refused}_token"):
        await attach(guarded, admin, data)


def test_a_recorded_dynamo_deployment_is_attached_to_by_its_frontend(tmp_path):
    where = {"provider": "dynamo", "dynamo": {"frontend_url": "http://f:1", "rl_url": "http://f:2"}}
    RunDir(tmp_path).record_fleet(where, {})
    assert not (tmp_path / "tokens.json").exists()  # Dynamo's own worker kind has no tokens
    config = Config(inference=InferenceConfig(admin_timeout_s=7, dynamo=DynamoConfig(worker="fleetrl")))
    attached = attached_to_run(config, RunDir(tmp_path).recorded_fleet()).inference
    assert (attached.provider, attached.dynamo.frontend_url, attached.dynamo.rl_url) == \
        ("dynamo", "http://f:1", "http://f:2")
    assert attached.admin_timeout_s == 7 and attached.dynamo.worker == "fleetrl"  # the rest stays the config's


def test_a_recorded_deployment_of_fleetrls_dynamo_kind_is_attached_to_with_its_admin_token(tmp_path):
    """fleetrl status RUN_DIR signs its calls to fleetrl's worker kind with the run's token, which
    the run wrote apart (tokens.json, this user's alone)."""
    where = {"provider": "dynamo", "dynamo": {"frontend_url": "http://f:1", "rl_url": "http://f:2", "worker": "fleetrl"}}
    RunDir(tmp_path).record_fleet(where, {"admin_token": "the-admin-token"})
    assert "the-admin-token" not in (tmp_path / "fleet.json").read_text()
    attached = attached_to_run(Config(), RunDir(tmp_path).recorded_fleet()).inference
    assert (attached.dynamo.worker, attached.admin_token) == ("fleetrl", "the-admin-token")
