"""Shared pieces of the integration tests: the real embedded model, real vLLM CPU servers."""

import copy
import fcntl
import functools
import os
import pty
import random
import signal
import struct
import subprocess
import sys
import termios
import threading
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import psutil
import pytest
import torch

from fleetrl.config import ModelConfig
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import GenerateRequest, SamplingParams
from fleetrl.model import resolve_model
from fleetrl.processes import stop_all
from fleetrl.records import StepLine
from fleetrl.rundir import RunDir
from fleetrl.tripwire import ENV as TRIPWIRE_ENV

from tests.tmp_folders import KEPT_FOLDERS

from .deployments import ROOT, DeploymentPool, _term_with_parent, deployment_of
from .probes import PROBE_TEXTS

_POOL = pytest.StashKey[DeploymentPool]()
# The title vLLM gives its engine-core process (where fleetrl's engines run the model).
ENGINE_CORE = "VLLM::EngineCore"


# The modules that run first: alone, they leave 25 to 43 % of the 2-core machine idle (a server
# starting on one core, a lease or a timer running out), which the tests `make test` runs beside
# them fill (scripts/test.sh). test_chaos and test_conformance, first before, leave 21 and 5 %.
IDLE_FIRST = ("test_providers.py", "test_dynamo_disaggregated.py", "test_dynamo_etcd.py")


def pytest_collection_modifyitems(items):
    """Every test here is an integration test; IDLE_FIRST's modules run first, and the modules
    of one shared deployment next to each other, where the first of them was collected
    (deployments.py)."""
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        if "tests/integration" in str(item.path):
            item.add_marker(pytest.mark.integration)
        if deployment_of(item):
            first.setdefault(deployment_of(item), i)
    position = {id(item): first.get(deployment_of(item), i) for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.path.name not in IDLE_FIRST, position[id(item)]))


@pytest.fixture(scope="module", autouse=True)
def tripwire_armed():
    """Every fleetrl process a test starts (they inherit os.environ), and every command run here
    through `fleetrl.cli.main`, runs with the tripwire of process-wide state armed
    (fleetrl/tripwire.py): a guarded setter called off the main thread ends it with status 1 and a
    line naming the setter and the thread. Module-scoped and autouse: set before the module's own
    fixtures start their runs, and gone before the unit tests of the same session."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TRIPWIRE_ENV, "1")
        yield


@pytest.fixture(scope="session")
def deployments(request, tmp_path_factory) -> DeploymentPool:
    """The session's shared deployments (deployments.py)."""
    if _POOL not in request.config.stash:
        logs = tmp_path_factory.mktemp("deployments")
        KEPT_FOLDERS.add(logs)  # its servers outlive the module that started them
        request.config.stash[_POOL] = DeploymentPool(logs)
    return request.config.stash[_POOL]


@pytest.fixture(scope="module")
def operator_servers(deployments) -> list[str]:
    """The URLs of two vLLM servers an operator started with the quickstart's commands."""
    return deployments.operator_servers()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """A shared deployment stops as soon as the next test does not use it (or none is left)."""
    pool = item.config.stash.get(_POOL, None)
    if pool is not None and pool.name and (nextitem is None or deployment_of(nextitem) != pool.name):
        pool.release()


def pytest_sessionfinish(session):
    pool = session.config.stash.get(_POOL, None)
    if pool is not None:
        pool.release()


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


# Standard normal values drawn once, beyond the largest tensor's size: each tensor of each version
# reads its noise from a window of them. Drawing 135M new values took 0.6 s per version's
# weights, and the suite builds about 60.
NOISE_MARGIN = 1 << 20


@functools.cache
def noise_bank(largest: int) -> torch.Tensor:
    return torch.randn(largest + NOISE_MARGIN, generator=torch.Generator().manual_seed(0))


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.05):
    """Weights of policy version `seed`: the model's own plus deterministic noise, big enough
    that greedy decoding differs from the base model at almost every position. Each tensor's
    noise starts at an offset of its own, drawn from the version and the tensor's index."""

    def named_tensors():
        params = list(model.named_parameters())
        bank = noise_bank(max(param.numel() for _, param in params))
        for i, (name, param) in enumerate(params):
            start = random.Random(seed * 1000 + i).randrange(bank.numel() - param.numel() + 1)
            noise = bank[start:start + param.numel()].view(param.shape)
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


@asynccontextmanager
async def running(fleet: Fleet):
    """A started fleet, closed (and every process stopped) however the block ends."""
    try:
        await fleet.start()
        yield fleet
    finally:
        await fleet.close()
        stop_all()


def process_table() -> list[tuple[int, int, int, str]]:
    """(pid, ppid, process group, state) of every process."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat"], capture_output=True, text=True).stdout
    return [(int(pid), int(ppid), int(pgid), stat) for pid, ppid, pgid, stat in
            (line.split() for line in out.splitlines()[1:])]


def child_groups(pid: int) -> set[int]:
    """The process groups fleetrl started: each server runs in its own, with its engine."""
    # fleetrl starts each in a new session: the child leads its own group. Other children
    # (multiprocessing's resource tracker, say) share the caller's group and are not counted.
    return {pgid for child, ppid, pgid, _ in process_table() if ppid == pid and pgid == child}


def descendant_groups(pid: int) -> set[int]:
    """The process groups led by any descendant of `pid`: what `child_groups` counts, at any
    depth (a torchrun agent's ranks, and what its rank 0 started in turn)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for child, ppid, pgid, _ in process_table():
        children.setdefault(ppid, []).append((child, pgid))
    groups, parents = set(), [pid]
    while parents:
        for child, pgid in children.get(parents.pop(), []):
            parents.append(child)
            if pgid == child:
                groups.add(child)
    return groups


def alive_in(groups: set[int]) -> list[int]:
    """The processes of `groups` that still run. A zombie has ended: an engine core's worker,
    orphaned as the engine exits, waits as one until init reaps it, which this machine's init
    does seconds late (CI saw one right after `fleetrl inference` returned). fleetrl counts
    them the same way (processes._running)."""
    return [pid for pid, _, pgid, stat in process_table() if pgid in groups and not stat.startswith("Z")]


# The smallest rollouts that still make a learning step (groups of 2), strictly on-policy: the
# runs of the fault tests are about the faults, not about learning.
TINY_ROLLOUTS = """
[orchestrator]
env = "reverse_text"
batch_prompts = 2
group_size = 2
max_tokens = 8
max_off_policy_steps = 0
"""


def check_episodes(run_dir: Path, steps: int, max_turns: int) -> None:
    """Every sample of a multi-turn run is an episode: up to max_turns model turns, the loss on
    exactly those, a span opened by each; feedback after a wrong answer gave some a second turn."""
    run = RunDir(run_dir)
    records = [record for step in range(1, steps + 1) for record in run.read_rollouts(step)]
    assert records and all(1 <= len(r.turns) <= max_turns and r.end in ("done", "max_turns") for r in records)
    assert any(len(r.turns) == 2 for r in records), [r.messages for r in records]
    for sample in run.read_batch(1).samples:
        model = {i for start, end in sample.turns for i in range(start, end)}
        assert {i for i, m in enumerate(sample.loss_mask) if m} == model
        assert {start for start, _ in sample.turns} <= {span.start for span in sample.spans}


def adapter_bytes(run_dir: Path) -> int:
    """What one publish of a LoRA run's adapter moves onto each worker: its fp32 tensors' bytes."""
    from fleetrl.config import load_config
    from fleetrl.lora import zero_adapter

    config = load_config([run_dir / "config.toml"], [])
    return sum(t.numel() * 4 for t in zero_adapter(resolve_model(config.model), config.trainer.lora.spec).values())


def check_adapter_folders_trained(folders: list[Path]) -> None:
    """Each launched worker's adapter folder holds a trained adapter (a B moved off 0), not the
    zero one that every worker is started (and restarted) with: the refits reached them all."""
    from safetensors.torch import load_file

    assert folders
    for folder in folders:
        tensors = load_file(folder / "adapter_model.safetensors")
        assert any(t.any() for name, t in tensors.items() if name.endswith("lora_B.weight")), folder


def read_metrics(run_dir) -> list[StepLine]:
    """An rl run's step lines so far ([] before its first step), read as `fleetrl verify` reads them."""
    return RunDir(run_dir).read_metrics() if (run_dir / "metrics.jsonl").exists() else []


@contextmanager
def fleetrl_process(*args: str, shell: str | None = None, terminal: bool = False, env: dict[str, str] | None = None):
    """`python -m fleetrl ARGS` as a user runs it, or `shell`, a command line of the quickstart
    (tests/documented.py) run by bash from the repository root in a session of its own, with
    `env` exported too. It gets SIGTERM (and so stops everything it started) if the test ends
    early or pytest itself dies. `terminal`: its stdout and stderr are a pseudo-terminal, as in a
    user's shell; `output(proc)` is what it wrote."""
    argv = ["bash", "-c", shell] if shell else [sys.executable, "-m", "fleetrl", *args]
    options = dict(preexec_fn=_term_with_parent, cwd=ROOT, start_new_session=shell is not None,
                   env={**os.environ, **(env or {})})
    if terminal:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))  # 40 rows, 140 columns
        options["env"]["TERM"] = "xterm"
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, **options)
        os.close(slave)
        proc.chunks = []
        reader = threading.Thread(target=_read_terminal, args=(master, proc.chunks), daemon=True)
        reader.start()
    else:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **options)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            # A shell command's whole session (make, and the fleetrl it started) gets the signal.
            os.killpg(proc.pid, signal.SIGTERM) if shell else proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if terminal:
            reader.join(timeout=10)


def fleetrl_pid(proc) -> int:
    """The `fleetrl` process behind `proc`: `proc` itself (bash exec'd it), or the one that make
    started; `proc` while neither has started yet."""
    def is_fleetrl(cmd: list[str]) -> bool:
        return len(cmd) > 1 and "python" in Path(cmd[0]).name and (
            cmd[1].endswith("/fleetrl") or cmd[1:3] == ["-m", "fleetrl"])

    try:
        me = psutil.Process(proc.pid)
        for process in [me, *me.children(recursive=True)]:
            if is_fleetrl(process.cmdline()):
                return process.pid
    except psutil.NoSuchProcess:
        pass
    return proc.pid


def _read_terminal(master: int, chunks: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)


def output(proc) -> str:
    """Everything a `fleetrl_process` wrote (on a terminal: with its control sequences)."""
    return b"".join(proc.chunks).decode(errors="replace") if hasattr(proc, "chunks") else proc.stdout.read()
