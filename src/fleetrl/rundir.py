"""The run directory: what a run leaves behind, its manifest, and `fleetrl verify`.

    RUN_DIR/
      config.toml            the resolved config
      metrics.jsonl          one line per trainer step
      batches/step_N.json    what step N trained on (samples with their version spans)
      rollouts/step_N.jsonl  every sampled completion, trained or dropped, with its spans
      checkpoints/step_N/    model + optimizer + step
      reward.png, off_policy.png
      logs/                  each process's log
      weights/               filesystem transport scratch (recent versions)
      dynamo-discovery/      file discovery of a launched Dynamo deployment
      manifest.json          every artifact above (but logs, weights, dynamo-discovery) with its sha256

`verify_run` re-checks the manifest and the run's invariants from the artifacts themselves,
and reports the first violation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fleetrl.batch import Batch

from fleetrl.versions import off_policy_distance
from fleetrl.config import load_config
from fleetrl.errors import FleetrlError
from fleetrl.files import sha256_file

MANIFEST = "manifest.json"
# logs change after the fact; weights/ is the transport's scratch; dynamo-discovery/ is a
# launched Dynamo deployment's live registry, emptied as its processes stop.
UNLISTED = ("logs", "weights", "dynamo-discovery", "kv-store")


class VerifyError(FleetrlError):
    pass


def artifacts(run_dir: Path) -> list[Path]:
    return sorted(
        p for p in run_dir.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
        and p.relative_to(run_dir).parts[0] not in UNLISTED
    )


def write_manifest(run_dir: Path) -> Path:
    entries = {str(p.relative_to(run_dir)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
               for p in artifacts(run_dir)}
    tmp = run_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"artifacts": entries}, indent=1, sort_keys=True))
    os.replace(tmp, run_dir / MANIFEST)
    return run_dir / MANIFEST


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def verify_run(run_dir: Path) -> str:
    """Raise VerifyError at the first violation; return a one-line summary if all hold."""
    run_dir = Path(run_dir)
    manifest_path = run_dir / MANIFEST
    if not manifest_path.exists():
        raise VerifyError(f"{run_dir}: no {MANIFEST} (the run did not finish, or this is not a run directory)")
    listed = json.loads(manifest_path.read_text())["artifacts"]
    for name, entry in listed.items():
        path = run_dir / name
        if not path.exists():
            raise VerifyError(f"{name}: listed in the manifest but missing")
        if sha256_file(path) != entry["sha256"]:
            raise VerifyError(f"{name}: sha256 differs from the manifest")
    unlisted = [str(p.relative_to(run_dir)) for p in artifacts(run_dir) if str(p.relative_to(run_dir)) not in listed]
    if unlisted:
        raise VerifyError(f"{unlisted[0]}: an artifact the manifest does not list")

    k = load_config([run_dir / "config.toml"], []).orchestrator.max_off_policy_steps
    metrics = read_metrics(run_dir)
    if not metrics:
        raise VerifyError("metrics.jsonl has no step")
    for line in metrics:
        if line["distance_max"] > k:
            raise VerifyError(f"step {line['step']}: off-policy distance {line['distance_max']} > k = {k}")
    samples = 0
    for line in metrics:
        batch = Batch.load(run_dir / "batches" / f"step_{line['step']:06d}.json")
        for i, sample in enumerate(batch.samples):
            distance = off_policy_distance(batch.step, sample.spans)
            if distance > k:
                raise VerifyError(f"step {batch.step}: sample {i} was trained at off-policy distance {distance} > k = {k}")
        samples += len(batch.samples)
    final = metrics[-1]
    for worker, version in final["worker_versions"].items():
        if version != final["step"]:
            raise VerifyError(f"worker {worker} ended at version {version}, not the final version {final['step']}")
    return (f"{run_dir}: {len(listed)} artifacts match the manifest; {len(metrics)} steps, {samples} trained "
            f"samples, max off-policy distance {max(m['distance_max'] for m in metrics)} <= k = {k}; "
            f"{len(final['worker_versions'])} worker(s) at the final version {final['step']}")
