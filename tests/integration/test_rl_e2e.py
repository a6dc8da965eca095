"""`fleetrl rl` end to end, as users run it (tests/integration/runs.py lists every run): the
README's and quickstart's `make run` as written, the quickstart's resume of it, and a cluster as
this machine can simulate one (a trainer rank on each of two torchrun "nodes", Dynamo with etcd,
NATS, a prefill and a decode worker). Each run is a module fixture (the first `make run` beside
the LoRA run, the resume beside the LoRA adapter's export served by plain vLLM); each check is a
small test that reads it, so one failed check does not hide the others."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from fleetrl.inference.http import prompt_logprobs_of
from fleetrl.processes import free_port
from fleetrl.records import StepLine
from fleetrl.rundir import RunDir

from tests.documented import documented, run_documented

from .conftest import (adapter_bytes, alive_in, check_adapter_folders_trained, check_episodes, child_groups,
                       descendant_groups, fleetrl_pid, fleetrl_process, output, read_metrics)
from .deployments import serving
from .runs import RUNS

# The torchrun run's own config (make-run and resume take configs/default.toml as written).
CLUSTER_CONFIG = """
[inference.vllm]
max_model_len = 512

[orchestrator]
batch_prompts = 2
group_size = 4
max_tokens = 16

[trainer]
lr = 1e-5
lr_decay = "linear"
lr_min = 1e-6
checkpoint_interval = 5

[trainer.loss]
mis_level = "geometric"
mis_low = 0.5
mis_high = 2.0

# Evaluation at v0, v1 and v2 on held-out arithmetic prompts (the taskset has no held-out split).
[eval]
every_steps = 1
prompts = 2
envs = [{name = "arithmetic"}]
"""


@dataclass
class Finished:
    """What a finished run left, read once as it ended (a later run may continue its directory)."""

    run_dir: Path
    out: str
    returncode: int
    groups: set[int]  # the process groups it started, seen while it ran
    steps: int
    k: int
    workers: int
    metrics: list[StepLine] = field(default_factory=list)
    final: dict = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)

    def read(self) -> "Finished":
        self.metrics = read_metrics(self.run_dir)
        if (self.run_dir / "final.json").exists():
            self.final = json.loads((self.run_dir / "final.json").read_text())
        self.events = [json.loads(line) for line in (self.run_dir / "events.jsonl").read_text().splitlines()]
        return self


def watch_run(run_dir: Path, procs: list, started_groups) -> set[int]:
    """Waits for every one of `procs` to end, checking the fleet's record as it runs; the
    process groups `started_groups()` saw on the way."""
    groups: set[int] = set()
    deadline = time.monotonic() + 1500
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        groups |= started_groups()
        check_the_fleet_record(run_dir)
        time.sleep(0.5)
    assert all(p.poll() is not None for p in procs), "the run did not finish in time"
    return groups


def check_the_fleet_record(run_dir) -> None:
    """While the run's fleet is up, what `fleetrl status RUN_DIR` reads: its settings, and its
    tokens in a file that only this user can read (none with Dynamo, which takes no tokens)."""
    try:
        if (run_dir / "fleet.json").exists():
            assert json.loads((run_dir / "fleet.json").read_text())
        mode = (run_dir / "tokens.json").stat().st_mode & 0o777
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or removed as the run ends
        return
    assert mode == 0o600, oct(mode)


def plain(out: str) -> str:
    """What a terminal showed, without its control sequences."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)


def make_run(run_dir: Path, command: str, steps: int) -> Finished:
    """A documented `make run` command in a terminal, as from a user's shell."""
    shell = documented(command, "--run.dir", str(run_dir), "--run.max_steps", str(steps))
    with fleetrl_process(shell=shell, terminal=True) as proc:
        groups = watch_run(run_dir, [proc], lambda: child_groups(fleetrl_pid(proc)))
    return Finished(run_dir, output(proc), proc.returncode, groups, steps, k=1, workers=1).read()


@pytest.fixture(scope="module")
def first_and_lora(tmp_path_factory) -> tuple[Finished, Finished]:
    """The first `make run` and the LoRA one, side by side, as two users' runs on one machine:
    they share nothing (each has its run directory and its launched worker), and either alone
    leaves a quarter of the machine idle (a worker's start, the waits between rollouts and steps)."""
    first_dir, lora_dir = tmp_path_factory.mktemp("make-run") / "run", tmp_path_factory.mktemp("lora") / "run"
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(make_run, first_dir, RUNS["make-run"].command, 2)
        lora = pool.submit(make_run, lora_dir, RUNS["lora"].command, 2)
        return first.result(), lora.result()


@pytest.fixture(scope="module")
def first_run(first_and_lora) -> Finished:
    return first_and_lora[0]


@pytest.fixture(scope="module")
def resumed_beside_the_adapter_export(first_run, lora, tmp_path_factory) -> tuple[Finished, Future]:
    """The quickstart's resume of the first run and, beside it, the LoRA run's adapter exported
    and served by a plain vLLM server (`serve_the_adapter_export`, whose Future its test reads:
    what it raised fails that test alone). They share nothing, and a server's start leaves a
    core idle."""
    log_path = tmp_path_factory.mktemp("lora-export") / "plain-vllm.log"
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(serve_the_adapter_export, lora, log_path)
        return make_run(first_run.run_dir, RUNS["resume"].command, steps=3), served


@pytest.fixture(scope="module")
def resumed(resumed_beside_the_adapter_export) -> Finished:
    return resumed_beside_the_adapter_export[0]


@pytest.fixture(scope="module")
def lora(first_and_lora) -> Finished:
    return first_and_lora[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Finished:
    """`fleetrl rl` on every rank of two torchrun "nodes" on this machine (two agents meeting at
    a c10d rendezvous), as docs/cluster.md runs it. One rank a node: with two a node, the four
    ranks beside two Dynamo workers, etcd and NATS came within a few GB of this machine's 24 and
    were once killed for memory; several local ranks under torchrun are covered by
    test_trainer_ranks.py (four on one node)."""
    tmp_path = tmp_path_factory.mktemp("torchrun-dynamo")
    tasksets = {"PYTHONPATH": str(Path(__file__).parent / "tasksets")}  # the taskset, for every rank
    config = tmp_path / "rl.toml"
    config.write_text(CLUSTER_CONFIG)
    run_dir, steps = tmp_path / "run", 2
    flags = RUNS["torchrun-dynamo"].command.split(" rl @ rl.toml ", 1)[1]
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    torchrun = shlex.join([str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "e2e", "-m", "fleetrl"])
    shell = f"exec {torchrun} rl @ {shlex.quote(str(config))} {flags} --run.dir {shlex.quote(str(run_dir))} " \
            f"--run.max_steps {steps}"
    with fleetrl_process(shell=shell, env=tasksets) as node_a, fleetrl_process(shell=shell, env=tasksets) as node_b:
        groups = watch_run(run_dir, [node_a, node_b],
                           lambda: descendant_groups(node_a.pid) | descendant_groups(node_b.pid))
    out = output(node_a) + output(node_b)
    returncode = node_a.returncode or node_b.returncode
    return Finished(run_dir, out, returncode, groups, steps, k=0, workers=2).read()


@pytest.fixture(scope="module", params=["first_run", "resumed", "lora", "cluster"])
def run(request) -> Finished:
    """Each run, for the checks of what it recorded as it ended."""
    finished = request.getfixturevalue(request.param)
    assert finished.returncode == 0, finished.out[-5000:]
    return finished


@pytest.fixture(scope="module", params=["resumed", "lora", "cluster"])
def last_run(request) -> Finished:
    """Each run whose directory no later run continues, for the checks that read the directory
    (the resume continues the first run's: its directory holds both)."""
    finished = request.getfixturevalue(request.param)
    assert finished.returncode == 0, finished.out[-5000:]
    return finished


# -- every run ---------------------------------------------------------------------------------


def test_every_step_ran_once_within_k(run):
    assert [m.step for m in run.metrics] == list(range(1, run.steps + 1))
    distances = [m.update.max_off_policy for m in run.metrics]
    assert all(distance <= run.k for distance in distances), distances


def test_every_worker_ends_at_the_final_version_holding_what_the_trainer_sent(run):
    assert run.final["version"] == run.steps
    assert len(run.final["workers"]) == run.workers
    for worker in run.final["workers"].values():
        assert worker["version"] == run.steps
        assert worker["checksum"] == run.metrics[-1].publish.checksum
    assert len(run.final["tokens"]) == 16 and run.final["spans"] == [[run.steps, 0]]


@functools.cache
def verified(run_dir: Path) -> subprocess.CompletedProcess:
    """The quickstart's `fleetrl verify` of a run directory, run once per directory: it hashes
    every checkpoint, which takes tens of seconds here."""
    return quickstart(".venv/bin/fleetrl verify runs/default", run_dir)


def test_the_run_leaves_plots_a_checkpoint_and_passes_verify(last_run):
    run_dir = last_run.run_dir
    assert (run_dir / "reward.png").stat().st_size > 0 and (run_dir / "off_policy.png").stat().st_size > 0
    assert (run_dir / "checkpoints" / f"step_{last_run.steps:06d}").is_dir()
    verify = verified(run_dir)
    assert verify.returncode == 0, verify.stderr
    distance = max(m.update.max_off_policy for m in last_run.metrics)
    assert f"max off-policy distance {distance} <= k = {last_run.k}" in verify.stdout
    assert "artifacts match the manifest" in verify.stdout


def test_the_final_model_scores_the_probe_as_the_trainer_did(last_run):
    """RUN_DIR/final_model, listed in the manifest, loads in transformers and scores the
    agreement probe as the trainer did at the final version."""
    import torch
    from transformers import AutoModelForCausalLM

    from fleetrl.trainer.model import prompt_logprobs

    listed = json.loads((last_run.run_dir / "manifest.json").read_text())["artifacts"]
    assert {"final_model/model.safetensors", "final_model/config.json", "final_model/tokenizer.json"} <= set(listed)
    model = AutoModelForCausalLM.from_pretrained(last_run.run_dir / "final_model", dtype=torch.float32).eval()
    scored = prompt_logprobs(model, last_run.final["probe"]["token_ids"], torch.device("cpu"))
    assert max(abs(a - b) for a, b in zip(scored, last_run.final["probe"]["trainer_logprobs"], strict=True)) < 1e-4


def test_events_hold_a_fence_per_version_and_each_samples_spans(run):
    """events.jsonl, which the timeline is drawn from: a fence opened and closed for each
    version this run published, every worker updating inside the fences, and every step's
    samples with spans that start at token 0, grow in version and stay within their tokens."""
    resumed_after = next((int(m) for m in re.findall(r"resuming after step (\d+)", plain(run.out))), 0)
    fences = [(e["phase"], e["version"]) for e in run.events if e["event"] == "fence"]
    # a resumed run publishes the checkpoint's version again before its first rollout
    versions = list(range(1, run.steps + 1)) if not resumed_after else \
        list(range(1, resumed_after + 1)) + list(range(resumed_after, run.steps + 1))
    assert fences == [(phase, v) for v in versions for phase in ("start", "end")], fences
    updating = {e["worker"] for e in run.events if e["event"] == "worker" and e["state"] == "updating"}
    assert updating == set(run.final["workers"]), updating
    samples = [e for e in run.events if e["event"] == "sample" and e["tokens"]]  # an empty one has no span
    assert {e["step"] for e in samples} >= set(range(1, run.steps + 1))
    for e in samples:
        versions, starts = [v for v, _ in e["spans"]], [start for _, start in e["spans"]]
        assert starts[0] == 0 and starts == sorted(set(starts)) and starts[-1] < e["tokens"], e
        assert versions == sorted(versions) and e["start"] <= e["end"], e
        if run.k == 0:  # sampled only once the step before was published: all of it at that version
            assert set(versions) == {e["step"] - 1}, e  # (a span per turn of a multi-turn episode)
    assert not (run.run_dir / "fleet.json").exists() and not (run.run_dir / "tokens.json").exists()


def test_every_token_agrees_with_the_trainer_at_its_own_version(run):
    """mismatch_kl (issue 28, item 6): each token scored by the trainer at the version that
    sampled it, fp32 on both sides, agrees with its worker to at most 1e-6, at k = 1 (tokens a
    version behind scored under that version) as at k = 0; every trained token is measured, and
    only tokens sampled a version behind are stale."""
    for m in run.metrics:
        update = m.update
        assert update.mismatch_tokens == update.completion_tokens, m
        assert update.mismatch_kl is not None and update.mismatch_kl <= 1e-6, m
        assert all(kl <= 1e-6 for kl in update.worker_mismatch_kl.values() if kl is not None), m
        assert not update.mismatch_outliers, m
        assert update.staleness_kl >= 0 and (update.max_off_policy > 0 or update.staleness_kl == 0), m
    assert any(kl is not None for m in run.metrics for kl in m.update.worker_mismatch_kl.values())


def test_no_process_is_left(run):
    """Servers, engine cores, etcd, NATS and trainer ranks all ended with the run."""
    assert len(run.groups) >= 1 and not alive_in(run.groups)


# -- make run, as written, and its resume --------------------------------------------------------


def test_make_run_is_the_default_one_worker_one_rank(first_run):
    assert "steps, k = 1, 1 trainer rank(s), env reverse_text" in plain(first_run.out)


def test_make_run_overlaps_rollouts_with_training(first_run):
    """k = 1: rollouts for step n+1 ran while step n trained (recorded timestamps)."""
    metrics = first_run.metrics
    overlaps = [nxt.batch.rollout_started < prev.train_finished for prev, nxt in zip(metrics, metrics[1:])]
    assert any(overlaps), [(m.batch.rollout_started, m.train_started, m.train_finished) for m in metrics]


def test_make_run_shows_the_live_view_and_its_log_lines(first_run):
    """What a terminal showed: startup bars, the step bar at the end, the rollouts of a step, the
    trainer's phases, the worker table; and every plain line the run logs, above the view."""
    text = plain(first_run.out)
    steps = first_run.steps
    assert re.search(r"starting 1 vLLM worker\(s\) +[━╸╺ ]+ *\d/1", text)  # a bar ...
    assert "fleetrl: waiting for" not in text  # ... not the plain "waiting" lines
    assert re.search(rf"steps\s.*\s{steps}/{steps}\s", text), text[-3000:]
    assert re.search(r"rollouts of step \d\s.*\s32/32\s", text)  # batch_prompts x group_size
    for phase in ("waiting for batch 1", "training step 2", "publishing v2"):  # phases that last seconds
        assert f"trainer: {phase}" in text, phase
    assert re.search(r"worker\s+role\s+state\s+version\s+in flight", text)
    assert re.search(rf"vllm-0\s+aggregated\s+ready\s+v{steps}\s+0", text)
    assert f"step {steps}/{steps}  reward" in text and "fleetrl: done:" in text


def test_the_resume_goes_on_from_the_checkpoint_at_its_version(resumed):
    """The workers (launched anew, at the base model) are brought to the checkpoint's version
    before any rollout: the resumed step's samples are all of it."""
    checkpoint = resumed.steps - 1
    assert f"resuming after step {checkpoint}" in plain(resumed.out)
    batch = RunDir(resumed.run_dir).read_batch(resumed.steps)
    assert batch.meta.dispatch_version == checkpoint
    assert all(span.version == checkpoint for sample in batch.samples for span in sample.spans)


def quickstart(command: str, run_dir: Path) -> subprocess.CompletedProcess:
    """A quickstart command on the run in `run_dir` (its `runs/default`)."""
    return run_documented(command, replace={"runs/default": str(run_dir)})


def test_the_quickstarts_status_verify_and_plot_on_the_finished_run(resumed):
    run_dir = resumed.run_dir
    status = quickstart(".venv/bin/fleetrl status runs/default", run_dir)
    assert status.returncode == 0, status.stderr
    assert f"finished at v{resumed.steps}" in status.stdout, status.stdout
    assert status.stdout.count(" stopped ") == 1, status.stdout  # its one worker
    verify = verified(run_dir)  # the quickstart's command, as written
    assert verify.returncode == 0 and "artifacts match the manifest" in verify.stdout, verify.stderr
    before = (run_dir / "timeline.png").read_bytes()
    plot = quickstart(".venv/bin/fleetrl plot runs/default", run_dir)
    assert plot.returncode == 0 and f"wrote {run_dir / 'timeline.png'}" in plot.stdout, plot.stderr
    assert (run_dir / "timeline.png").read_bytes() == before  # the same records draw the same picture


def test_the_quickstarts_tensorboard_serves_the_runs_scalars(resumed):
    port = free_port("127.0.0.1")
    with fleetrl_process(shell=documented(".venv/bin/tensorboard --logdir runs/default/tensorboard", "--port", str(port),
                                          replace={"runs/default": str(resumed.run_dir)})) as board:
        deadline = time.monotonic() + 120
        while True:
            assert board.poll() is None and time.monotonic() < deadline, output(board)[-2000:]
            try:
                tags = httpx.get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5)
                if tags.status_code == 200 and tags.json():
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
    (scalars,) = tags.json().values()  # one run: the event files of this run
    # Charted by their path in the step line (docs/quickstart.md).
    assert {"batch/reward_mean", "update/loss", "batch/workers/vllm-0/tokens_per_s",
            "publish/worker_seconds/vllm-0"} <= set(scalars), sorted(scalars)


# -- LoRA (the quickstart's section 8) -----------------------------------------------------------

# The quickstart's export of the LoRA run's adapter, and the plain vLLM server of it on the base model.
EXPORT_ADAPTER = ".venv/bin/fleetrl export runs/lora runs/lora-adapter --adapter"
SERVE_ADAPTER = ("VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m "
                 "vllm.entrypoints.openai.api_server --model \"$(.venv/bin/fleetrl model)\" --dtype float32 "
                 "--max-model-len 512 --enforce-eager --enable-lora "
                 "--max-lora-rank 16 --lora-target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj "
                 "--lora-modules lora=runs/lora-adapter --port 8000")


def test_a_lora_publish_moves_the_adapter_alone(lora, first_run):
    """Every publish moved onto the worker exactly the adapter's bytes (fp32), a few percent of
    what the same job's publishes move in full fine-tuning (make run's)."""
    expected = adapter_bytes(lora.run_dir)
    (full,) = {moved for m in first_run.metrics for moved in m.publish.received_bytes.values()}
    assert expected < full / 20
    for m in lora.metrics:
        assert list(m.publish.received_bytes.values()) == [expected], m.publish
    check_adapter_folders_trained(list(lora.run_dir.rglob("vllm-*-adapter")))


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_alone(lora):
    from torch.distributed.checkpoint import FileSystemReader

    folder = lora.run_dir / "checkpoints" / f"step_{lora.steps:06d}"
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 16
    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    weights = [k for k in keys if not k.startswith("optimizer")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights if "weight" in k), weights[:5]


def serve_the_adapter_export(lora: Finished, log_path: Path) -> tuple[dict[str, list[float]], list[list[float]]]:
    """The quickstart's `fleetrl export --adapter` of the LoRA run, served by its plain vLLM
    command: the agreement probe's logprobs through the adapter ("lora") and through the base
    model ("base": by the name the server gives it), and through the adapter three times among
    sampled requests."""
    export = run_documented(EXPORT_ADAPTER, replace={"runs/lora": str(lora.run_dir)})  # into RUN_DIR-adapter
    assert export.returncode == 0, export.stderr
    adapter = Path(f"{lora.run_dir}-adapter")
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    probe = lora.final["probe"]["token_ids"]
    port = str(free_port("127.0.0.1"))
    url = f"http://127.0.0.1:{port}"
    command = documented(SERVE_ADAPTER, replace={"runs/lora-adapter": str(adapter), "8000": port})
    with serving(command, url, log_path):
        base_name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        scored = {key: prompt_logprobs_of(probe, httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": name, "prompt": probe, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
        }).json()["choices"][0]["prompt_logprobs"]) for key, name in (("lora", "lora"), ("base", base_name))}
        return scored, asyncio.run(probe_among_sampled_requests(url, probe))


def test_the_lora_adapter_export_serves_on_plain_vllm_as_the_workers_did(lora, resumed_beside_the_adapter_export):
    """The quickstart's `fleetrl export --adapter`, served by a plain vLLM server on the base model
    (vLLM's own LoRA, no fleetrl code): through the adapter it scores the agreement probe as the
    trainer did at the final version, also in a batch with sampled requests (which failed on a
    CPU until the adapter's layers were named: fleetrl's workers score the probe while kept
    requests go on); without it, as the base model does, which is another score (the probe
    through the adapter measured something)."""
    scored, mixed = resumed_beside_the_adapter_export[1].result()
    trainer = lora.final["probe"]["trainer_logprobs"]
    assert max(abs(a - b) for a, b in zip(scored["lora"], trainer, strict=True)) < 2e-3
    assert max(abs(a - b) for a, b in zip(scored["base"], trainer, strict=True)) > 2e-3
    for among_others in mixed:
        assert max(abs(a - b) for a, b in zip(among_others, trainer, strict=True)) < 2e-3


async def probe_among_sampled_requests(url: str, token_ids: list[int]) -> list[list[float]]:
    """The probe scored through the adapter three times while six sampled requests run: each
    scoring shares the engine's batch with them."""
    async with httpx.AsyncClient(timeout=120) as client:
        def completion(body: dict):
            return client.post(f"{url}/v1/completions", json={"model": "lora", **body})

        sampled = [asyncio.ensure_future(completion({"prompt": list(range(100, 130 + i)), "max_tokens": 64,
                                                     "ignore_eos": True})) for i in range(6)]
        await asyncio.sleep(0.5)  # they are being generated
        scorings = await asyncio.gather(*(completion({"prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
                                                      "prompt_logprobs": 0}) for _ in range(3)))
        for answer in [*scorings, *await asyncio.gather(*sampled)]:
            assert answer.status_code == 200, answer.text[:500]
    return [prompt_logprobs_of(token_ids, s.json()["choices"][0]["prompt_logprobs"]) for s in scorings]


# -- the cluster -------------------------------------------------------------------------------


def test_the_cluster_runs_a_rank_on_each_node_strictly_on_policy(cluster):
    """k = 0: sampling for batch n+1 starts only after step n has been published."""
    assert "2 trainer rank(s)" in cluster.out
    assert all(m.update.max_off_policy == 0 for m in cluster.metrics)
    for prev, nxt in zip(cluster.metrics, cluster.metrics[1:]):
        assert nxt.batch.rollout_started >= prev.train_finished


def test_the_clusters_learning_rate_decays_as_configured(cluster):
    """trainer.lr_decay = linear over the run's 2 steps, toward lr_min: the peak, then half way."""
    assert [m.update.lr for m in cluster.metrics] == pytest.approx([1e-5, 5.5e-6])


def test_the_clusters_loss_masks_by_the_geometric_mean_and_reports_entropy(cluster):
    """The geometric mask's band [0.5, 2] on two FSDP ranks drops nothing where sampler and
    trainer agree; the policy's entropy is reported, below log(vocab) = 10.8."""
    assert all(m.update.masked_frac == 0 and 0 < m.update.entropy < 11 for m in cluster.metrics), cluster.metrics


def test_the_cluster_evaluates_every_version_on_held_out_prompts_at_that_version(cluster):
    """eval.every_steps = 1 on two FSDP ranks and Dynamo: the start version and each published one,
    every token of each evaluation of that version (as `fleetrl verify` checks too), the figures in
    eval.jsonl and in the evaluated step's line."""
    evals = RunDir(cluster.run_dir).read_evals()
    assert [e.version for e in evals] == [0, 1, 2]
    for e in evals:
        figures = e.envs["arithmetic"]
        assert figures.prompts == 2 and figures.samples == 2 and 0 <= figures.pass_at[1] <= 1, e
        records = [json.loads(line) for line in
                   RunDir(cluster.run_dir).eval_records_path(e.version).read_text().splitlines()]
        assert all({v for v, _ in r["spans"]} == {e.version} for r in records), records
        assert all(r["task"].startswith("arithmetic/") for r in records)
    assert [m.eval for m in cluster.metrics] == [evals[1].envs, evals[2].envs]
    assert "fleetrl: evaluated v2 in" in cluster.out


def test_the_cluster_prefills_on_one_worker_and_decodes_on_the_other(cluster):
    assert "Dynamo frontend and 2 worker(s) ready" in cluster.out
    assert (cluster.run_dir / "logs" / "etcd.log").stat().st_size > 0
    assert (cluster.run_dir / "logs" / "nats.log").stat().st_size > 0
    assert sorted(w["role"] for w in cluster.final["workers"].values()) == ["decode", "prefill"]
    prefill_id = next(i for i, w in cluster.final["workers"].items() if w["role"] == "prefill")
    rollouts = [json.loads(line) for line in (cluster.run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert rollouts and all(r["prefill_worker"] == prefill_id for r in rollouts), rollouts[0]


def test_the_clusters_verifiers_episodes_carry_versions_in_every_turn(cluster):
    """verifiers' own record of the run: an episode per sample, each model turn of its trace
    with the policy versions that produced it (k = 0: the step's policy), the episode stamped
    with the step and the versions it spans; fleetrl's episodes a span per turn."""
    check_episodes(cluster.run_dir, cluster.steps, max_turns=2)
    episodes = [json.loads(line) for line in RunDir(cluster.run_dir).verifiers_episodes_path.read_text().splitlines()]
    assert len(episodes) == cluster.steps * 2 * 4  # batch_prompts x group_size per step
    for episode in episodes:
        (trace,) = episode["traces"]
        stamp = trace["info"]["fleetrl"]
        step = stamp["step"]
        assert 1 <= len(stamp["turns"]) <= 2
        for turn in stamp["turns"]:
            assert turn["policy"] == {"start": step - 1, "end": step - 1}, stamp
        work = episode["run"]["work"]
        assert work["step"] == step and work["policy"] == {"start": step - 1, "end": step - 1}


def test_the_clusters_wandb_run_holds_the_steps_outside_the_manifest(cluster):
    (wandb_run,) = (cluster.run_dir / "wandb" / "wandb").glob("offline-run-*")
    assert list(wandb_run.glob("run-*.wandb")) and f"W&B run {wandb_run.name.rsplit('-', 1)[1]} (offline)" in cluster.out
    listed = json.loads((cluster.run_dir / "manifest.json").read_text())["artifacts"]
    assert not any(name.startswith("wandb/") for name in listed)
