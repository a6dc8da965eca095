"""`fleetrl rl` end to end, as a user runs it: 2 vLLM CPU workers (native, or Dynamo's behind a
Dynamo frontend with etcd and NATS), 2 trainer ranks (FSDP2 over gloo) that fleetrl starts
itself, or 4 that two torchrun "nodes" start, 5 orchestrator and 5 trainer steps, then
`fleetrl verify` on what it left behind."""

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

from fleetrl.processes import free_port
from fleetrl.rundir import RunDir

from tests.documented import documented

from .conftest import ROOT, alive_in, child_groups, descendant_groups, fleetrl_pid, fleetrl_process, output, read_metrics

STEPS = 5
CONFIG = """
[inference]
workers = 2

[inference.vllm]
max_model_len = 512

[orchestrator]
env = "reverse_text"
batch_prompts = 2
group_size = 4
max_tokens = 16

[trainer]
lr = 1e-5
checkpoint_interval = 5

[run]
max_steps = 5
"""


def rl_args(tmp_path, k: int, *flags: str) -> tuple[Path, list[str]]:
    """The run directory, and the arguments of `fleetrl rl` on CONFIG with `flags`."""
    config = tmp_path / "rl.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"
    return run_dir, ["@", str(config), "--run.dir", str(run_dir), "--orchestrator.max_off_policy_steps", str(k), *flags]


def run_rl(tmp_path, k: int, *flags: str, command: str | None = None, replace: dict[str, str] | None = None,
           terminal: bool = False) -> tuple[Path, set[int], str]:
    """`fleetrl rl` on CONFIG with 2 trainer ranks and `flags`; or the quickstart's `command`
    (the run directory's name in it replaced by `replace`'s key), with the same added to it."""
    run_dir, args = rl_args(tmp_path, k, "--trainer.world_size", "2", *flags)
    shell = documented(command, *args, replace=replace) if command else None
    with fleetrl_process(*(["rl"] + args if shell is None else []), shell=shell, terminal=terminal) as proc:
        # every server and trainer rank it starts
        groups = watch_run(run_dir, [proc], lambda: child_groups(fleetrl_pid(proc)))
    out = output(proc)
    assert proc.returncode == 0, out[-5000:]
    return run_dir, groups, out


def run_on_two_torchrun_nodes(tmp_path, k: int, *flags: str, command: str | None = None) -> tuple[Path, set[int], str]:
    """`fleetrl rl` on CONFIG and `flags` on every rank of two torchrun "nodes" on this machine
    (two agents meeting at a c10d rendezvous, 2 ranks each), as docs/cluster.md runs it; or the
    quickstart's `command` (a `.venv/bin/fleetrl rl` line) with `torchrun ... -m fleetrl` in place
    of the executable, and CONFIG and `flags` added."""
    run_dir, args = rl_args(tmp_path, k, *flags)
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    torchrun = shlex.join([str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "e2e", "-m", "fleetrl"])
    if command is None:
        shell = f"exec {torchrun} rl {shlex.join(args)}"
    else:
        shell = documented(command, *args, replace={".venv/bin/fleetrl": torchrun})
    with fleetrl_process(shell=shell) as node_a, fleetrl_process(shell=shell) as node_b:
        groups = watch_run(run_dir, [node_a, node_b], lambda: descendant_groups(node_a.pid) | descendant_groups(node_b.pid))
    out = output(node_a) + output(node_b)
    assert node_a.returncode == 0 and node_b.returncode == 0, out[-5000:]
    assert "4 trainer rank(s)" in out
    return run_dir, groups, out


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


def check_common(run_dir, groups, out, k):
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["distance_max"] <= k for m in metrics), [m["distance_max"] for m in metrics]
    # Every worker ends at the final version, holding exactly what the trainer sent.
    final = json.loads((run_dir / "final.json").read_text())
    assert final["version"] == STEPS
    assert len(final["workers"]) == 2
    for worker in final["workers"].values():
        assert worker["version"] == STEPS
        assert worker["checksum"] == metrics[-1]["checksum"]
    assert len(final["tokens"]) == 16 and final["spans"] == [[STEPS, 0]]
    assert (run_dir / "reward.png").stat().st_size > 0 and (run_dir / "off_policy.png").stat().st_size > 0
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}").is_dir()
    check_final_model(run_dir, final)
    check_events(run_dir, final, k)
    # No process is left: servers, engine cores and trainer ranks all ended with the run.
    assert len(groups) >= 3 and not alive_in(groups)
    verify = subprocess.run([sys.executable, "-m", "fleetrl", "verify", str(run_dir)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
    assert f"max off-policy distance {max(m['distance_max'] for m in metrics)} <= k = {k}" in verify.stdout
    return metrics


def check_episodes(run_dir: Path, max_turns: int) -> None:
    """Every sample of a multi-turn run is an episode: up to max_turns model turns, the loss on
    exactly those, a span opened by each; feedback after a wrong answer gave some a second turn."""
    run = RunDir(run_dir)
    records = [json.loads(line) for step in range(1, STEPS + 1) for line in run.rollouts_path(step).read_text().splitlines()]
    assert records and all(1 <= len(r["turns"]) <= max_turns and r["end"] in ("done", "max_turns") for r in records)
    assert any(len(r["turns"]) == 2 for r in records), [r["messages"] for r in records]
    for sample in run.read_batch(1).samples:
        model = {i for start, end in sample.turns for i in range(start, end)}
        assert {i for i, m in enumerate(sample.loss_mask) if m} == model
        assert {start for start, _ in sample.turns} <= {span.start for span in sample.spans}


def check_verifiers_traces(run_dir: Path) -> None:
    """verifiers' own record of the run: an episode per sample, each model turn of its trace
    with the policy versions that produced it (k = 0: the step's policy), the episode stamped
    with the step and the versions it spans."""
    episodes = [json.loads(line) for line in RunDir(run_dir).verifiers_episodes_path.read_text().splitlines()]
    assert len(episodes) == STEPS * 2 * 4  # batch_prompts x group_size per step
    for episode in episodes:
        (trace,) = episode["traces"]
        stamp = trace["info"]["fleetrl"]
        step = stamp["step"]
        assert 1 <= len(stamp["turns"]) <= 2
        for turn in stamp["turns"]:
            assert turn["policy"] == {"start": step - 1, "end": step - 1}, stamp
        work = episode["run"]["work"]
        assert work["step"] == step and work["policy"] == {"start": step - 1, "end": step - 1}


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


def check_events(run_dir, final: dict, k: int) -> None:
    """events.jsonl, which the timeline is drawn from, as the run recorded it: a fence opened
    and closed for each version, every worker updating inside the fences, and every step's
    samples with spans that start at token 0, grow in version and stay within their tokens."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    fences = [(e["phase"], e["version"]) for e in events if e["event"] == "fence"]
    assert fences == [(phase, v) for v in range(1, STEPS + 1) for phase in ("start", "end")], fences
    updating = {e["worker"] for e in events if e["event"] == "worker" and e["state"] == "updating"}
    assert updating == set(final["workers"]), updating
    samples = [e for e in events if e["event"] == "sample" and e["tokens"]]  # an empty one has no span
    assert {e["step"] for e in samples} >= set(range(1, STEPS + 1))
    for e in samples:
        versions, starts = [v for v, _ in e["spans"]], [start for _, start in e["spans"]]
        assert starts[0] == 0 and starts == sorted(set(starts)) and starts[-1] < e["tokens"], e
        assert versions == sorted(versions) and e["start"] <= e["end"], e
        if k == 0:  # sampled only once the step before was published: all of it at that version
            assert set(versions) == {e["step"] - 1}, e  # (a span per turn of a multi-turn episode)
    assert not (run_dir / "fleet.json").exists() and not (run_dir / "tokens.json").exists()  # gone with the fleet


def check_final_model(run_dir, final) -> None:
    """RUN_DIR/final_model, listed in the manifest, loads in transformers and scores the
    agreement probe as the trainer did at the final version."""
    import torch
    from transformers import AutoModelForCausalLM

    from fleetrl.trainer.model import prompt_logprobs

    listed = json.loads((run_dir / "manifest.json").read_text())["artifacts"]
    assert {"final_model/model.safetensors", "final_model/config.json", "final_model/tokenizer.json"} <= set(listed)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final_model", dtype=torch.float32).eval()
    scored = prompt_logprobs(model, final["probe"]["token_ids"], torch.device("cpu"))
    assert max(abs(a - b) for a, b in zip(scored, final["probe"]["trainer_logprobs"], strict=True)) < 1e-4


def quickstart(command: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    line = documented(command, *extra, replace={"runs/default": str(run_dir)})
    return subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=300)


def check_what_the_run_leaves(run_dir: Path) -> None:
    """The quickstart's status, verify, plot and TensorBoard on a finished run."""
    status = quickstart(".venv/bin/fleetrl status runs/default", run_dir)
    assert status.returncode == 0, status.stderr
    assert f"finished at v{STEPS}" in status.stdout and status.stdout.count(" stopped ") == 2, status.stdout
    verify = quickstart(".venv/bin/fleetrl verify runs/default", run_dir)
    assert verify.returncode == 0 and "artifacts match the manifest" in verify.stdout, verify.stderr
    before = (run_dir / "timeline.png").read_bytes()
    plot = quickstart(".venv/bin/fleetrl plot runs/default", run_dir)
    assert plot.returncode == 0 and f"wrote {run_dir / 'timeline.png'}" in plot.stdout, plot.stderr
    assert (run_dir / "timeline.png").read_bytes() == before  # the same records draw the same picture
    port = free_port("127.0.0.1")
    with fleetrl_process(shell=documented(".venv/bin/tensorboard --logdir runs/default/tensorboard", "--port", str(port),
                                          replace={"runs/default": str(run_dir)})) as board:
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
    (scalars,) = tags.json().values()  # one run: the event file of this run
    assert {"reward_mean", "loss", "worker/vllm-0/tokens_per_s", "worker/vllm-1/publish_s"} <= set(scalars)


def check_live_view(out: str) -> None:
    """What a terminal showed: startup bars, the step bar at the end, the rollouts of a step, the
    trainer's phases, the worker table; and every plain line the run logs, above the view."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)  # the control sequences
    assert re.search(r"starting 2 vLLM worker\(s\) +[━╸╺ ]+ *\d/2", text)  # a bar ...
    assert "fleetrl: waiting for" not in text  # ... not the plain "waiting" lines
    assert re.search(rf"steps\s.*\s{STEPS}/{STEPS}\s", text), text[-3000:]
    assert re.search(r"rollouts of step \d\s.*\s8/8\s", text)  # batch_prompts x group_size
    for phase in ("waiting for batch 1", "training step 2", "publishing v2"):  # phases that last seconds
        assert f"trainer: {phase}" in text, phase
    assert re.search(r"worker\s+role\s+state\s+version\s+in flight", text)
    assert re.search(rf"vllm-0\s+aggregated\s+ready\s+v{STEPS}\s+0", text)
    assert f"step {STEPS}/{STEPS}  reward" in text and "fleetrl: done:" in text


def test_four_ranks_on_two_torchrun_nodes(tmp_path):
    """A cluster as this machine can simulate one: two torchrun "nodes" (two agents meeting at a
    c10d rendezvous), 2 ranks each, so 4 FSDP2 trainer ranks; `fleetrl rl` on every rank, global
    rank 0 (on whichever node torchrun put it) hosting the fleet of 2 native workers. Strictly on
    policy, on the multi-turn arithmetic_retry task (`fleetrl verify` checks each episode's
    turns and spans); with W&B on too (offline): its run holds the steps, and its files stay out
    of the manifest."""
    run_dir, groups, out = run_on_two_torchrun_nodes(tmp_path, 0, "--run.wandb", "true", "--orchestrator.env",
                                                     "arithmetic_retry", "--orchestrator.max_turns", "2")
    metrics = check_common(run_dir, groups, out, k=0)
    check_episodes(run_dir, max_turns=2)
    (wandb_run,) = (run_dir / "wandb" / "wandb").glob("offline-run-*")
    assert list(wandb_run.glob("run-*.wandb")) and f"W&B run {wandb_run.name.rsplit('-', 1)[1]} (offline)" in out
    assert not any(name.startswith("wandb/") for name in json.loads((run_dir / "manifest.json").read_text())["artifacts"])
    assert all(m["distance_max"] == 0 for m in metrics)
    # k = 0: sampling for batch n+1 starts only after step n has been published.
    for prev, nxt in zip(metrics, metrics[1:]):
        assert nxt["rollout_started"] >= prev["train_finished"]


def test_one_step_off_policy_overlaps_rollouts_with_training(tmp_path):
    """The quickstart's first run (`make run`, with this module's config and k = 1), in a
    terminal as from a user's shell: the live view shows and the log lines still print. Then
    the quickstart's commands on what it left."""
    run_dir, groups, out = run_rl(tmp_path, k=1, command="make run", terminal=True)
    metrics = check_common(run_dir, groups, out, k=1)
    check_live_view(out)
    check_what_the_run_leaves(run_dir)
    # k = 1: rollouts for step n+1 ran while step n trained (recorded timestamps).
    overlaps = [nxt["rollout_started"] < prev["train_finished"] for prev, nxt in zip(metrics, metrics[1:])]
    assert any(overlaps), [(m["rollout_started"], m["train_started"], m["train_finished"]) for m in metrics]


def test_four_ranks_on_dynamo_with_etcd_and_nats_prefill_and_decode(tmp_path, monkeypatch):
    """The same loop, unchanged, on Dynamo as a cluster runs it: the quickstart's Dynamo command
    on two torchrun "nodes" (4 trainer ranks), with etcd discovery and the NATS event plane, both
    launched by fleetrl; a frontend, one prefill and one decode worker (Dynamo's own vLLM
    workers): every rollout's prompt is prefilled on the one and decoded on the other, and both
    are in every publish. The task is a verifiers multi-turn taskset, whose own Env asks again
    after a wrong answer: every turn of every trace carries its policy versions."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent / "tasksets"))  # the taskset, for every rank
    run_dir, groups, out = run_on_two_torchrun_nodes(
        tmp_path, 0, "--inference.workers", "1", "--inference.dynamo.prefill_workers", "1",
        "--inference.dynamo.discovery", "etcd", "--inference.dynamo.event_plane", "nats",
        "--orchestrator.env", "verifiers:fleetrl_retry_sum", "--orchestrator.max_turns", "2",
        command=".venv/bin/fleetrl rl @ configs/default.toml --inference.provider dynamo "
                "--run.dir runs/dynamo")  # the test's --run.dir comes later, and wins
    metrics = check_common(run_dir, groups, out, k=0)  # etcd and NATS among the groups: none left either
    check_episodes(run_dir, max_turns=2)
    check_verifiers_traces(run_dir)
    assert all(m["distance_max"] == 0 for m in metrics)
    assert "Dynamo frontend and 2 worker(s) ready" in out
    assert (run_dir / "logs" / "etcd.log").stat().st_size > 0 and (run_dir / "logs" / "nats.log").stat().st_size > 0
    final = json.loads((run_dir / "final.json").read_text())
    assert sorted(w["role"] for w in final["workers"].values()) == ["decode", "prefill"]
    prefill_id = next(i for i, w in final["workers"].items() if w["role"] == "prefill")
    rollouts = [json.loads(line) for line in (run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert rollouts and all(r["prefill_worker"] == prefill_id for r in rollouts), rollouts[0]
