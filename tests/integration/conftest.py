"""Shared pieces of the integration tests: the real embedded model, real vLLM CPU servers."""

import asyncio
import copy
import secrets
import subprocess
import sys
from contextlib import asynccontextmanager, contextmanager

import pytest
import pytest_asyncio
import torch

from fleetrl.config import InferenceConfig, ModelConfig
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.probe import PROBE_TEXTS
from fleetrl.inference.types import GenerateRequest, SamplingParams
from fleetrl.inference.vllm.provider import VllmProvider
from fleetrl.model import resolve_model
from fleetrl.processes import stop_all
from fleetrl.weights.transport import make_transport


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration" in str(item.path):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def model_dir():
    """The embedded model, converted for real (once per cache)."""
    return resolve_model(ModelConfig())


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def base_weights(model_dir):
    """The policy's weights as the trainer holds them: fp32, HF parameter names."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.05):
    """Weights of policy version `seed`: the model's own plus deterministic noise, big enough
    that greedy decoding differs from the base model at almost every position."""

    def named_tensors():
        for i, (name, param) in enumerate(model.named_parameters()):
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed * 1000 + i))
            yield name, (param.detach() + scale * noise).contiguous()

    return named_tensors


def model_with(base: torch.nn.Module, named_tensors) -> torch.nn.Module:
    model = copy.deepcopy(base)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in named_tensors():
            params[name].copy_(tensor)
    return model


@pytest.fixture(scope="session")
def probe(tokenizer):
    """Token ids of the texts that probe_fleet scores on every worker."""
    return [tokenizer(text)["input_ids"] for text in PROBE_TEXTS]


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


GREEDY = dict(temperature=0.0, ignore_eos=True)


async def greedy_response(fleet: Fleet, prompt: list[int], max_tokens: int):
    (out,) = await fleet.generate(GenerateRequest(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY)))
    return out


async def greedy(fleet: Fleet, prompt: list[int], max_tokens: int) -> list[int]:
    return (await greedy_response(fleet, prompt, max_tokens)).token_ids


async def publish_during_request(fleet, base_weights, storage, kind, prompt, max_tokens):
    """Start a greedy request, publish the next version by `kind` while it runs, return it."""
    version = fleet.version + 1
    transport = make_transport(kind, host="127.0.0.1", bucket_bytes=32 << 20, storage_dir=storage)
    try:
        in_flight = asyncio.create_task(greedy_response(fleet, prompt, max_tokens))
        await asyncio.sleep(2.0)
        await fleet.publish(version, transport, perturbed(base_weights, seed=version))
        return await in_flight
    finally:
        await transport.close()


# Per-token versions, checked the same way on every worker kind that reports them.

async def check_keep_mode_span_boundary(fleet, base_weights, tokenizer, storage, kind: str) -> None:
    """Keep mode: a request in flight across a publish gets two spans, split at the exact token."""
    old = fleet.version
    prompt = chat_ids(tokenizer, "Write a long story about a lighthouse keeper.")
    reference = await greedy(fleet, prompt, 400)  # all at `old`
    out = await publish_during_request(fleet, base_weights, storage, kind, prompt, 400)
    assert [s.version for s in out.spans] == [old, old + 1], out.spans
    boundary = out.spans[1].start
    assert 0 < boundary < 400
    assert out.token_ids[:boundary] == reference[:boundary]
    # From the boundary on, the tokens are the new policy's greedy continuation of the prefix.
    continuation = await greedy(fleet, prompt + reference[:boundary], 400 - boundary)
    assert out.token_ids[boundary:] == continuation
    assert continuation[0] != reference[boundary]  # the weights really changed right there


async def check_abort_mode_joins_spans(fleet, base_weights, tokenizer, storage, kind: str) -> None:
    """Abort mode: the cut request is continued after the publish and its spans joined."""
    old, mode = fleet.version, fleet.pause_mode
    prompt = chat_ids(tokenizer, "List every prime number you know, one per line.")
    fleet.pause_mode = "abort"
    try:
        out = await publish_during_request(fleet, base_weights, storage, kind, prompt, 300)
    finally:
        fleet.pause_mode = mode
    assert len(out.token_ids) == 300 and out.finish_reason == "length"
    assert [s.version for s in out.spans] == [old, old + 1], out.spans
    boundary = out.spans[1].start
    continuation = await greedy(fleet, prompt + out.token_ids[:boundary], 300 - boundary)
    assert out.token_ids[boundary:] == continuation


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def native_fleet(request, model_dir, tmp_path_factory):
    """A fleet of real vLLM CPU servers for one test module (`workers` from the module, default 1).

    Always stopped at the end of the module, pass or fail.
    """
    workers = getattr(request.module, "WORKERS", 1)
    config = InferenceConfig(workers=workers, max_model_len=512, admin_timeout_s=120, startup_timeout_s=900)
    log_dir = tmp_path_factory.mktemp("fleet-logs")
    provider = VllmProvider(config, model_dir, log_dir, secrets.token_urlsafe(16))
    async with running(Fleet(provider, discovery_interval_s=3600)) as fleet:
        yield fleet


@asynccontextmanager
async def running(fleet: Fleet):
    """A started fleet, closed (and every process stopped) however the block ends."""
    try:
        await fleet.start()
        yield fleet
    finally:
        await fleet.close()
        stop_all()


def process_table() -> list[tuple[int, int, int]]:
    """(pid, ppid, process group) of every process."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,pgid"], capture_output=True, text=True).stdout
    return [tuple(map(int, line.split())) for line in out.splitlines()[1:]]


def child_groups(pid: int) -> set[int]:
    """The process groups fleetrl started: each server runs in its own, with its engine."""
    # fleetrl starts each in a new session: the child leads its own group. Other children
    # (multiprocessing's resource tracker, say) share the caller's group and are not counted.
    return {pgid for child, ppid, pgid in process_table() if ppid == pid and pgid == child}


def alive_in(groups: set[int]) -> list[int]:
    return [pid for pid, _, pgid in process_table() if pgid in groups]


def _term_with_parent() -> None:
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    # As from a terminal: a test runner started as a background job (`cmd &`) ignores
    # SIGINT, and a child would inherit that, so Ctrl-C tests would test nothing.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextmanager
def fleetrl_process(*args: str):
    """`python -m fleetrl ARGS` as a user runs it. It gets SIGTERM (and so stops everything it
    started) if the test ends early or pytest itself dies."""
    proc = subprocess.Popen([sys.executable, "-m", "fleetrl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_term_with_parent)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
