"""The run directory: the one owner of its paths and its writes, its manifest, and `fleetrl verify`.

    RUN_DIR/
      config.toml            the resolved config
      metrics.jsonl          one line per trainer step
      batches/step_N.json    what step N trained on (samples with their version spans)
      rollouts/step_N.jsonl  every sampled completion, trained or dropped, with its spans
      checkpoints/step_N/    model + optimizer + step (written by fleetrl.trainer.checkpoint)
      final.json             a greedy sample of the final policy, and every worker's version
      reward.png, off_policy.png
      verifiers_episodes.jsonl  a `verifiers` environment's episodes, when it runs one
      logs/                  each process's log
      weights/               filesystem transport scratch (recent versions)
      dynamo-discovery/      file discovery of a launched Dynamo deployment
      manifest.json          every artifact above (but logs, weights, dynamo-discovery) with its sha256

Every file is written whole or not at all (`files.atomic_write`), so a reader — a trainer rank
waiting for a batch, `fleetrl verify`, a resumed run — never sees half of one. The one
exception is metrics.jsonl, which grows by one line per step.

`verify_run` re-checks the manifest and the run's invariants from the artifacts themselves,
and reports the first violation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from fleetrl.batch import Batch
from fleetrl.config import Config, load_config, to_toml
from fleetrl.errors import FleetrlError
from fleetrl.files import atomic_write, sha256_file
from fleetrl.plots import off_policy_plot, reward_plot
from fleetrl.versions import off_policy_distance

MANIFEST = "manifest.json"
# logs change after the fact; weights/ is the transport's scratch; dynamo-discovery/ (and the
# kv-store/ of its key-value store) is a launched Dynamo deployment's live registry, emptied
# as its processes stop.
UNLISTED = ("logs", "weights", "dynamo-discovery", "kv-store")
STEP_PREFIX = "step_"


def step_name(step: int) -> str:
    """The name of step `step`'s batch, rollouts and checkpoint (without a suffix): step_000003."""
    return f"{STEP_PREFIX}{step:06d}"


def step_of(path: Path) -> int:
    """The step a `step_N` file or folder is for; ValueError for any other name."""
    name = Path(path).name
    if not name.startswith(STEP_PREFIX):
        raise ValueError(f"{name} is not named after a step")
    return int(name.removeprefix(STEP_PREFIX).split(".")[0])


class VerifyError(FleetrlError):
    pass


class RunDir:
    """The paths of one run directory, and every write into it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.config_path = self.root / "config.toml"
        self.metrics_path = self.root / "metrics.jsonl"
        self.final_path = self.root / "final.json"
        self.manifest_path = self.root / MANIFEST
        self.reward_plot_path = self.root / "reward.png"
        self.off_policy_plot_path = self.root / "off_policy.png"
        self.verifiers_episodes_path = self.root / "verifiers_episodes.jsonl"
        self.batches_dir = self.root / "batches"
        self.rollouts_dir = self.root / "rollouts"
        self.checkpoints_dir = self.root / "checkpoints"
        self.logs_dir = self.root / "logs"
        self.weights_dir = self.root / "weights"

    def batch_path(self, step: int) -> Path:
        return self.batches_dir / f"{step_name(step)}.json"

    def rollouts_path(self, step: int) -> Path:
        return self.rollouts_dir / f"{step_name(step)}.jsonl"

    def log_path(self, process: str) -> Path:
        return self.logs_dir / f"{process}.log"

    def start(self, config: Config, resume: int) -> None:
        """Make the directory ready for a run that continues after step `resume` (0: a new run)."""
        if not resume and self.read_metrics():
            raise FleetrlError(f"run.dir {self.root} holds a run without a checkpoint to resume from; "
                               f"choose another run.dir or remove it")
        # Steps after the checkpoint are redone: drop their batches, rollouts and metric lines.
        for folder in (self.batches_dir, self.rollouts_dir):
            for path in folder.glob(f"{STEP_PREFIX}*"):
                if step_of(path) > resume:
                    path.unlink()
        kept = [m for m in self.read_metrics() if m["step"] <= resume]
        atomic_write(self.metrics_path, "".join(json.dumps(m) + "\n" for m in kept))
        atomic_write(self.config_path, to_toml(config))
        self.manifest_path.unlink(missing_ok=True)

    def write_batch(self, batch: Batch) -> Path:
        return atomic_write(self.batch_path(batch.step), batch.to_json())

    def read_batch(self, step: int) -> Batch:
        return Batch.from_json(self.batch_path(step).read_text())

    def wait_batch(self, step: int, while_waiting: Callable[[], None] = lambda: None) -> Batch:
        """Batch `step` once the orchestrator has written it; `while_waiting` runs between looks
        (and raises to give up)."""
        while not self.batch_path(step).exists():
            while_waiting()
            time.sleep(0.1)
        return self.read_batch(step)

    def write_rollouts(self, step: int, records: list[dict]) -> Path:
        return atomic_write(self.rollouts_path(step), "".join(json.dumps(r) + "\n" for r in records))

    def append_metrics(self, line: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def read_metrics(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def write_final(self, final: dict) -> Path:
        return atomic_write(self.final_path, json.dumps(final, indent=1))

    def write_plots(self) -> None:
        metrics = self.read_metrics()
        atomic_write(self.reward_plot_path, reward_plot(metrics))
        atomic_write(self.off_policy_plot_path, off_policy_plot(metrics))

    def artifacts(self) -> list[Path]:
        return sorted(
            p for p in self.root.rglob("*")
            if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
            and p.relative_to(self.root).parts[0] not in UNLISTED
        )

    def write_manifest(self) -> Path:
        entries = {str(p.relative_to(self.root)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                   for p in self.artifacts()}
        return atomic_write(self.manifest_path, json.dumps({"artifacts": entries}, indent=1, sort_keys=True))


def verify_run(root: Path) -> str:
    """Raise VerifyError at the first violation; return a one-line summary if all hold."""
    run_dir = RunDir(root)
    if not run_dir.manifest_path.exists():
        raise VerifyError(f"{run_dir.root}: no {MANIFEST} (the run did not finish, or this is not a run directory)")
    listed = json.loads(run_dir.manifest_path.read_text())["artifacts"]
    for name, entry in listed.items():
        path = run_dir.root / name
        if not path.exists():
            raise VerifyError(f"{name}: listed in the manifest but missing")
        if sha256_file(path) != entry["sha256"]:
            raise VerifyError(f"{name}: sha256 differs from the manifest")
    unlisted = [name for p in run_dir.artifacts() if (name := str(p.relative_to(run_dir.root))) not in listed]
    if unlisted:
        raise VerifyError(f"{unlisted[0]}: an artifact the manifest does not list")

    k = load_config([run_dir.config_path], []).orchestrator.max_off_policy_steps
    metrics = run_dir.read_metrics()
    if not metrics:
        raise VerifyError("metrics.jsonl has no step")
    for line in metrics:
        if line["distance_max"] > k:
            raise VerifyError(f"step {line['step']}: off-policy distance {line['distance_max']} > k = {k}")
    samples = 0
    for line in metrics:
        batch = run_dir.read_batch(line["step"])
        for i, sample in enumerate(batch.samples):
            distance = off_policy_distance(batch.step, sample.spans)
            if distance > k:
                raise VerifyError(f"step {batch.step}: sample {i} was trained at off-policy distance {distance} > k = {k}")
        samples += len(batch.samples)
    final = metrics[-1]
    for worker, version in final["worker_versions"].items():
        if version != final["step"]:
            raise VerifyError(f"worker {worker} ended at version {version}, not the final version {final['step']}")
    return (f"{run_dir.root}: {len(listed)} artifacts match the manifest; {len(metrics)} steps, {samples} trained "
            f"samples, max off-policy distance {max(m['distance_max'] for m in metrics)} <= k = {k}; "
            f"{len(final['worker_versions'])} worker(s) at the final version {final['step']}")
