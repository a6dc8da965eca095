"""The run directory: the one owner of its paths and its writes, its manifest, and `fleetrl verify`.
`RunDir.start` locks the directory for the whole run and refuses a resume that changes what the
run means (`RUN_DEFINING`); every file is written whole or not at all, except the line-by-line
files (metrics.jsonl, events.jsonl, verifiers_episodes.jsonl), whose lines are synced as they are
appended and whose torn last line is dropped when read. `verify_run` re-checks the manifest and
the run's invariants from the artifacts themselves and reports the first violation. What each
file is: docs/quickstart.md, section 3; the faults this guards against: docs/reliability.md,
"Nothing lost"."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from collections.abc import Callable
from functools import reduce
from pathlib import Path

from fleetrl.batch import Batch, Sample
from fleetrl.config import Config, ConfigError, load_config, to_toml
from fleetrl.errors import FleetrlError
from fleetrl.files import LineWriter, append_line, atomic_write, fsync_dir, read_json_lines, sha256_file
from fleetrl.plots import eval_plot, off_policy_plot, reward_plot, timeline_plot
from fleetrl.records import (EvalFigures, EvalLine, FinalRecord, FlatStepLine, FleetEvent, RolloutRecord, SftLine,
                             StepLine, event_to_dict, read_event, read_step_line, trained_distance)
from fleetrl.versions import is_run_id, new_run_id, off_policy_distance

MANIFEST = "manifest.json"
# logs change after the fact, and so may W&B's files (its own process writes them); weights/
# is the transport's scratch; dynamo-discovery/ (and the kv-store/ of its key-value store) is a
# launched Dynamo deployment's live registry, emptied as its processes stop.
# fleet.json and tokens.json describe the live fleet (and hold its secrets).
# etcd/ and nats/ are the stores of an etcd and a NATS launched for Dynamo, live until the fleet stops.
# run_id is written by the first resume of a run from before run ids were kept: a finished run
# whose resume then fails still matches its manifest.
UNLISTED = ("logs", "wandb", "weights", "dynamo-discovery", "kv-store", "etcd", "nats", "fleet.json", "tokens.json",
            "run_id")
STEP_PREFIX = "step_"
KINDS = {"rl": StepLine, "sft": SftLine}  # a run's kind (the command that made it): its metrics.jsonl records
LOCK = ".lock"  # a dot-file: never an artifact of the manifest

# What a run *is*. A resume that changed one of these would go on, under the same run.dir and
# from the same checkpoint, with a run that means something else, so it is refused; everything
# else (steps, workers, timeouts, logging, the learning rate) may change between the two.
# Each kind of run's (KINDS); the model folder and data files themselves are fingerprinted (`start`'s inputs).
RUN_DEFINING = {"rl": (
    "model.path",  # the policy the checkpoints hold weights of
    "orchestrator.env",  # the tasks and their reward
    "orchestrator.env_options",  # the same
    "orchestrator.envs",  # the same, when several
    "orchestrator.batch_prompts",  # a resume skips the tasks of the steps done: batch_prompts per step
    "orchestrator.group_size",  # how many samples each advantage is relative to
    "orchestrator.dynamic_sampling",  # which tasks each step draws (its window of the stream)
    "orchestrator.dynamic_sampling_prompts",  # the same
    "orchestrator.normalize_advantages_std",  # the advantage itself (GRPO or Dr. GRPO)
    "orchestrator.max_off_policy_steps",  # k: `fleetrl verify` checks every step against config.toml's
    "trainer.loss",  # the gradient each batch gives (a refusal names the field that changed)
    "trainer.lora",  # what is trained (adapter or all weights) and what the checkpoints hold
    "run.seed",  # the task stream the resume continues
), "sft": (
    "model.path",
    "trainer.lora",
    "run.seed",  # the order of the rows
    "sft.path",  # the rows each step trains on
    "sft.split",
    "sft.messages_field",
    "sft.prompt_field",
    "sft.completion_field",
    "sft.sequences_per_step",  # a resume skips the rows of the steps done
)}


def path_fingerprint(path: Path) -> str:
    """A file's or a folder's identity, as hex (`data_files.file_fingerprint` of each file, a
    folder's by their names; hidden ones, a download's locks say, left out): cheap for big
    models, it reads 2 MiB of each file at most."""
    from fleetrl.data_files import file_fingerprint  # `datasets` and pandas: only where a run starts

    path = Path(path)
    if path.is_file():
        return file_fingerprint(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(path).parts))
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(path)} {file_fingerprint(file)}\n".encode())
    return digest.hexdigest()


def step_name(step: int) -> str:
    """The name of step `step`'s batch, rollouts and checkpoint (without a suffix): step_000003."""
    return f"{STEP_PREFIX}{step:06d}"


def step_of(path: Path) -> int:
    """The step a `step_N` file or folder is for; ValueError for any other name."""
    name = Path(path).name
    if not name.startswith(STEP_PREFIX):
        raise ValueError(f"{name} is not named after a step")
    return int(name.removeprefix(STEP_PREFIX).split(".")[0])


def episode_step(record: dict) -> int:
    """The trainer step a verifiers episode record was generated for: verifiers' own run stamp
    (`TrainRunInfo.work.step`), which fleetrl's adapter sets to the rollout's step."""
    return record["run"]["work"]["step"]


def json_lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


class VerifyError(FleetrlError):
    pass


@dataclass(frozen=True)
class DeploymentPaths:
    """Where the processes of a deployment fleetrl starts keep their files: its log per process,
    and Dynamo's etcd and NATS data, file discovery and shared-storage KV. A run's directory
    (`RunDir.deployment`), or the folder of an operator's deployment
    (deploy/dynamo/start_etcd_deployment.py)."""

    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def adapter(self, process: str) -> Path:
        """A launched Dynamo worker's LoRA adapter folder (a LoRA run's), beside its log."""
        return self.logs / f"{process}-adapter"

    @property
    def etcd(self) -> Path:
        return self.root / "etcd"

    @property
    def nats(self) -> Path:
        return self.root / "nats"

    @property
    def discovery(self) -> Path:
        """Dynamo's file discovery (DYN_FILE_KV), without etcd."""
        return self.root / "dynamo-discovery"

    @property
    def kv_store(self) -> Path:
        """Shared-storage KV of prefill/decode workers (vLLM's ExampleConnector)."""
        return self.root / "kv-store"


class RunDir:
    """The paths of one run directory, and every write into it."""

    def __init__(self, root: Path, log=print, kind: str = "rl") -> None:
        """`kind`: the command whose run this is, `fleetrl rl`'s or `fleetrl sft`'s (KINDS)."""
        self.root = Path(root)
        self.log = log
        self.kind = kind
        self.lines = KINDS[kind]  # the record of metrics.jsonl
        self.kind_path = self.root / "kind"
        self.fingerprints_path = self.root / "fingerprints.json"  # of `start`'s inputs, at the run's first start
        self.config_path = self.root / "config.toml"
        self.metrics_path = self.root / "metrics.jsonl"
        self.final_path = self.root / "final.json"
        self.final_model_dir = self.root / "final_model"
        self.manifest_path = self.root / MANIFEST
        self.reward_plot_path = self.root / "reward.png"
        self.off_policy_plot_path = self.root / "off_policy.png"
        self.timeline_plot_path = self.root / "timeline.png"
        self.eval_plot_path = self.root / "eval.png"
        self.events_path = self.root / "events.jsonl"
        self._events = LineWriter(self.events_path)  # appended from the event loop: synced off it
        self.verifiers_episodes_path = self.root / "verifiers_episodes.jsonl"
        self.fleet_path = self.root / "fleet.json"
        self.tokens_path = self.root / "tokens.json"
        self.run_id_path = self.root / "run_id"
        self._run_id: str | None = None  # read or drawn once (`run_id`)
        self.batches_dir = self.root / "batches"
        self.rollouts_dir = self.root / "rollouts"
        self.eval_dir = self.root / "eval"  # each evaluation's records, by version (step_N: version N)
        self.eval_path = self.root / "eval.jsonl"  # a line per evaluation: its version and figures
        self.checkpoints_dir = self.root / "checkpoints"
        self.deployment = DeploymentPaths(self.root)  # the inference processes' files
        self.logs_dir = self.deployment.logs
        self.tensorboard_dir = self.root / "tensorboard"
        self.wandb_dir = self.root / "wandb"
        self.weights_dir = self.root / "weights"
        self.lock_path = self.root / LOCK
        self._lock_fd: int | None = None  # open while this RunDir holds the lock

    @classmethod
    def of(cls, root: Path, log=print) -> RunDir:
        """The run directory `root` as the kind of run it holds (`recorded_kind`)."""
        return cls(root, log=log, kind=cls(root).recorded_kind() or "rl")

    def recorded_kind(self) -> str | None:
        """The kind of run the directory holds: its `kind` file, which every new run's start
        writes; without one "rl" where it holds a run (one from before kinds were kept, all of
        them `fleetrl rl`'s), else None."""
        if not self.kind_path.exists():
            return "rl" if self.metrics_path.exists() else None
        kind = self.kind_path.read_text().strip()
        if kind not in KINDS:
            raise FleetrlError(f"{self.kind_path}: {kind[:40]!r} is not a kind of run ({', '.join(KINDS)})")
        return kind

    def check_kind(self) -> None:
        """Refuse to run this command's kind of run in a directory that holds the other kind."""
        if (held := self.recorded_kind()) not in (None, self.kind):
            raise FleetrlError(f"run.dir {self.root} holds a `fleetrl {held}` run; a `fleetrl {self.kind}` run "
                               f"needs a run.dir of its own (choose another run.dir)")

    def read_config(self) -> Config:
        """The run's config.toml, which an older fleetrl may have written: its keys that have
        moved since are read in their places now (config.loader.MOVED_KEYS)."""
        return load_config([], [], saved=[self.config_path])

    def batch_path(self, step: int) -> Path:
        return self.batches_dir / f"{step_name(step)}.json"

    def rollouts_path(self, step: int) -> Path:
        return self.rollouts_dir / f"{step_name(step)}.jsonl"

    def eval_records_path(self, version: int) -> Path:
        return self.eval_dir / f"{step_name(version)}.jsonl"

    def log_path(self, process: str) -> Path:
        return self.deployment.log(process)

    def start(self, config: Config, resume: int, inputs: dict[str, Path] | None = None) -> None:
        """Lock the directory for this run (`close` lets go) and make it ready for a run that
        continues after step `resume` (0: a new run). `inputs`: the model folder and data files
        the run reads, by config key (model.path, sft.path): a new run keeps their fingerprints,
        and a resume whose files changed since (a final model an SFT run rewrote) is refused.
        Everything is checked before anything is
        written: a refused start leaves the directory as it was (but for the lock file) and
        holds nothing. What a finished run took home, its final model and manifest, stays until
        this run writes their replacements (`replace_final_model`, `write_manifest`)."""
        self.lock()
        try:
            self.check_kind()
            config_text = to_toml(config)  # read back as it was, or refused: before anything is removed
            metrics = self.read_metrics()
            episodes = read_json_lines(self.verifiers_episodes_path, self.log)
            events = self.read_events()  # a torn last line is dropped, as from the metrics
            if not resume and metrics:
                raise FleetrlError(f"run.dir {self.root} holds a run without a checkpoint to resume from "
                                   "(trainer.checkpoint_interval sets when one is written; 0: never); choose "
                                   "another run.dir or remove it")
            if not resume and not metrics and (why := self._not_a_run()):
                raise FleetrlError(f"run.dir {self.root} is not empty and holds no fleetrl run ({why}); "
                                   f"choose an empty or new folder")
            if resume and self.config_path.exists():
                self._check_resume_keeps_the_run(config)
            fingerprints = {key: path_fingerprint(path) for key, path in (inputs or {}).items()}
            if resume and self.fingerprints_path.exists():  # none: a run from before they were kept
                for key, then in json.loads(self.fingerprints_path.read_text()).items():
                    if key in fingerprints and fingerprints[key] != then:
                        raise FleetrlError(f"run.dir {self.root}: resume with {key} {str(inputs[key])!r}, whose files "
                                           "changed since the run started; a resumed run must keep what the run "
                                           "means (start a new run.dir)")
            self.run_id()  # one the directory holds is checked before anything is written
            # Steps after the checkpoint are redone: drop their batches, rollouts, metric lines
            # and verifiers episodes. Each rewrite is synced to disk before it replaces the file.
            for folder in (self.batches_dir, self.rollouts_dir, self.eval_dir):
                for path in folder.glob(f"{STEP_PREFIX}*"):
                    if step_of(path) > resume:
                        path.unlink()
            atomic_write(self.metrics_path, json_lines([m.to_dict() for m in metrics if m.step <= resume]), durable=True)
            if self.eval_path.exists():
                atomic_write(self.eval_path, json_lines([e.to_dict() for e in self.read_evals() if e.version <= resume]),
                             durable=True)
            if self.verifiers_episodes_path.exists():
                atomic_write(self.verifiers_episodes_path,
                             json_lines([e for e in episodes if episode_step(e) <= resume]), durable=True)
            if self.events_path.exists():  # the timeline keeps what happened, the redone steps too
                self._events.close()  # its next line goes to the file written here, not the one replaced
                atomic_write(self.events_path, json_lines([event_to_dict(e) for e in events]), durable=True)
            self.record_run_id()
            if not resume:  # a resume keeps the kind check_kind found (none: an older `fleetrl rl` run)
                atomic_write(self.kind_path, self.kind + "\n", durable=True)
                atomic_write(self.fingerprints_path, json.dumps(fingerprints, indent=1, sort_keys=True) + "\n",
                             durable=True)
            atomic_write(self.config_path, config_text, durable=True)
            fsync_dir(self.root)
        except BaseException:
            self.close()
            raise

    def run_id(self) -> str:
        """The run's identity in its workers' labels and claims (versions.Label): drawn at random
        for its first start and kept in the directory (`record_run_id`), so every resume reads it
        back (and takes back the workers the run held), and no other run has it. A directory
        that holds none yet (a new run, or one from before run ids were kept) gets one drawn
        here, the same for every call on this RunDir: the fleet labels the workers with it
        before `start` writes it."""
        if self._run_id is None:
            self._run_id = self._recorded_run_id() or new_run_id()
        return self._run_id

    def record_run_id(self) -> None:
        """Keep `run_id` in the directory, written whole, unless it holds it already (`start`).
        It replaces one that another start wrote since this RunDir drew its own: the file names
        the run whose fleet labels the workers."""
        if self._recorded_run_id() != self.run_id():
            atomic_write(self.run_id_path, self.run_id() + "\n", durable=True)

    def _recorded_run_id(self) -> str | None:
        if not self.run_id_path.exists():
            return None
        run = self.run_id_path.read_text().strip()
        if not is_run_id(run):
            raise FleetrlError(f"{self.run_id_path}: {run[:80]!r} is not a run id (ASCII letters and digits, "
                               "up to 64): remove the file to give the run a new one")
        return run

    def _not_a_run(self) -> str | None:
        """Why a directory that is not empty holds no fleetrl run; None if it holds one, or
        nothing but what a start of fleetrl's may leave before its config.toml (the lock).
        `run.dir` = "" or "/", or a project's folder with a config.toml of its own, must never be
        cleaned up as a run: a run's config.toml is one fleetrl reads back as its config."""
        if not self.config_path.exists():
            return "no config.toml" if any(p.name != LOCK for p in self.root.iterdir()) else None
        try:
            self.read_config()
        except ConfigError as e:
            return f"its config.toml is not a fleetrl config: {e}"
        if not self.metrics_path.exists():  # every start writes it before its config.toml
            return "a config.toml but no metrics.jsonl beside it, which every start of fleetrl's writes first"
        return None

    def replace_final_model(self, write: Callable[[Path], None]) -> Path:
        """The final model, written by `write(folder)` beside the one there, then swapped in: a
        resumed run that fails keeps the final model the run had."""
        new, old = self.root / ".new-final_model", self.root / ".old-final_model"
        if old.exists() and not self.final_model_dir.exists():
            os.rename(old, self.final_model_dir)  # a run killed between the two renames: the model it had
        for leftover in (new, old):  # of a run killed as it wrote
            shutil.rmtree(leftover, ignore_errors=True)
        write(new)
        if self.final_model_dir.exists():
            os.rename(self.final_model_dir, old)
        os.rename(new, self.final_model_dir)
        shutil.rmtree(old, ignore_errors=True)
        return self.final_model_dir

    def close(self) -> None:
        """Let go of the directory `start` locked. The lock also ends with the process, however
        it dies: it is an flock on an open file, which the kernel drops with the file."""
        try:
            self._events.close()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def lock(self) -> None:
        """Hold the directory for this run (a second run is refused, naming this one's pid);
        a no-op where this RunDir holds it already."""
        if self._lock_fd is not None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 64).decode().strip()  # empty while the holder is still writing it
            os.close(fd)
            holder = f"fleetrl pid {pid}" if pid else "another fleetrl"
            raise FleetrlError(f"run.dir {self.root} is in use by {holder}; one run at a time per "
                               f"run.dir (stop that one, or choose another run.dir)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _check_resume_keeps_the_run(self, config: Config) -> None:
        now = config.model_dump(mode="json")
        then = self.read_config().model_dump(mode="json")
        for name in RUN_DEFINING[self.kind]:
            new, old = (reduce(dict.__getitem__, name.split("."), values) for values in (now, then))
            if new != old:
                name, new, old = _first_change(name, new, old)
                raise FleetrlError(f"run.dir {self.root}: resume with {name} {new!r} but the run was started "
                                   f"with {old!r}; a resumed run must keep what the run means (start a new run.dir)")

    def write_batch(self, batch: Batch) -> Path:
        return atomic_write(self.batch_path(batch.step), batch.to_json())

    def read_batch(self, step: int) -> Batch:
        path = self.batch_path(step)
        return Batch.from_json(path.read_text(), where=str(path))

    def wait_batch(self, step: int, while_waiting: Callable[[], None] = lambda: None) -> Batch:
        """Batch `step` once the orchestrator has written it; `while_waiting` runs between looks
        (and raises to give up)."""
        while not self.batch_path(step).exists():
            while_waiting()
            time.sleep(0.1)
        return self.read_batch(step)

    def write_rollouts(self, step: int, records: list[RolloutRecord]) -> Path:
        return atomic_write(self.rollouts_path(step), json_lines([r.to_dict() for r in records]))

    def append_metrics(self, line: StepLine | SftLine) -> None:
        append_line(self.metrics_path, json.dumps(line.to_dict()))

    def write_eval(self, records: list[RolloutRecord], line: EvalLine) -> None:
        """One evaluation: its records, then its line in eval.jsonl."""
        atomic_write(self.eval_records_path(line.version), json_lines([r.to_dict() for r in records]))
        append_line(self.eval_path, json.dumps(line.to_dict()))

    def _read_records(self, path: Path, read_record: Callable[[object, str], object]) -> list:
        """A record file's records, each read by `read_record` (records.py) with its place named."""
        return [read_record(data, f"{path}: record {i}") for i, data in enumerate(read_json_lines(path, self.log), 1)]

    def read_rollouts(self, step: int) -> list[RolloutRecord]:
        return self._read_records(self.rollouts_path(step), RolloutRecord.read)

    def read_eval_records(self, version: int) -> list[RolloutRecord]:
        return self._read_records(self.eval_records_path(version), RolloutRecord.read)

    def read_evals(self) -> list[EvalLine]:
        return self._read_records(self.eval_path, EvalLine.read)

    def read_metrics(self) -> list[StepLine | FlatStepLine] | list[SftLine]:
        """An rl run's lines may be in the flat form of a fleetrl before December 2026 (a run
        resumed across the upgrade has both): records.read_step_line reads either."""
        return self._read_records(self.metrics_path, SftLine.read if self.lines is SftLine else read_step_line)

    def write_final(self, final: FinalRecord) -> Path:
        return atomic_write(self.final_path, json.dumps(final.to_dict(), indent=1))

    def read_final(self) -> FinalRecord:
        return FinalRecord.read(json.loads(self.final_path.read_text()), str(self.final_path))

    def append_event(self, event: FleetEvent) -> None:
        """One event of the timeline (events.jsonl), stamped with its wall time (`t`); written
        and synced by a thread of its own (`read_events` and `close` wait for it)."""
        self._events.append(json.dumps(event_to_dict(event)))

    def read_events(self) -> list[FleetEvent]:
        self._events.flush()
        return self._read_records(self.events_path, read_event)

    def write_plots(self) -> list[Path]:
        """reward.png and off_policy.png from the metrics, timeline.png from the events, and
        eval.png from eval.jsonl once the run has evaluated."""
        metrics = self.read_metrics()
        k = self.read_config().orchestrator.max_off_policy_steps
        written = [atomic_write(self.reward_plot_path, reward_plot(metrics)),
                   atomic_write(self.off_policy_plot_path, off_policy_plot(metrics)),
                   atomic_write(self.timeline_plot_path, timeline_plot(self.read_events(), k))]
        if evals := self.read_evals():
            written.append(atomic_write(self.eval_plot_path, eval_plot(evals)))
        return written

    def artifacts(self) -> list[Path]:
        """Every file of the run but the manifest, what UNLISTED names, and dot-files and dot-folders
        (the lock; a folder being written, like final_model's, left by a kill)."""
        def listed(path: Path) -> bool:
            parts = path.relative_to(self.root).parts
            return parts[0] not in UNLISTED and not any(part.startswith(".") for part in parts)

        return sorted(p for p in self.root.rglob("*") if p.is_file() and p.name != MANIFEST and listed(p))

    def write_manifest(self) -> Path:
        """The manifest of every artifact (the `kind` file among them)."""
        self._events.flush()  # every event appended so far is in the file it hashes
        entries = {str(p.relative_to(self.root)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                   for p in self.artifacts()}
        return atomic_write(self.manifest_path, json.dumps({"artifacts": entries}, indent=1, sort_keys=True))

    def record_fleet(self, settings: dict, tokens: dict) -> None:
        """Record the running fleet for `fleetrl status RUN_DIR`: the inference settings that
        attach to it (fleet.json) and its tokens (tokens.json, left out when it has none).
        tokens.json is created readable by this user alone (0600), so no other user can read
        it even for an instant, and replaces an older one whole (a temporary name, then a rename)."""
        self.root.mkdir(parents=True, exist_ok=True)
        if tokens:
            tmp = self.tokens_path.with_name(f".{self.tokens_path.name}.tmp")
            tmp.unlink(missing_ok=True)  # O_EXCL below: the file is new, and ours
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                json.dump(tokens, f)
            os.replace(tmp, self.tokens_path)
        else:
            self.tokens_path.unlink(missing_ok=True)
        atomic_write(self.fleet_path, json.dumps(settings, indent=1))

    def recorded_fleet(self) -> dict:
        """The settings and tokens `record_fleet` wrote, as one dict of inference settings."""
        if not self.fleet_path.exists():
            raise FleetrlError(f"{self.root}: no fleet.json: no fleet of this run is running (a run records "
                               "its fleet once it is up, and removes the record when it ends)")
        tokens = json.loads(self.tokens_path.read_text()) if self.tokens_path.exists() else {}
        return {**json.loads(self.fleet_path.read_text()), **tokens}

    def forget_fleet(self) -> None:
        """The fleet has stopped: its record and tokens go."""
        self.fleet_path.unlink(missing_ok=True)
        self.tokens_path.unlink(missing_ok=True)


def plot_run(root: Path) -> list[Path]:
    """`fleetrl plot RUN_DIR`: the run's plots, drawn again from what it has recorded so far.
    The same records draw the same bytes, so a finished run still matches its manifest."""
    run_dir = RunDir(root)
    if not run_dir.config_path.exists():
        raise FleetrlError(f"{run_dir.root}: no config.toml (not a run directory)")
    if run_dir.recorded_kind() == "sft":
        raise FleetrlError(f"{run_dir.root} holds a `fleetrl {run_dir.recorded_kind()}` run, which draws no plots: "
                           f"its loss per step is in {run_dir.metrics_path} (and TensorBoard, W&B)")
    if not run_dir.metrics_path.exists() and not run_dir.events_path.exists():
        raise FleetrlError(f"{run_dir.root}: nothing to draw yet (no metrics.jsonl or events.jsonl)")
    return run_dir.write_plots()


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

    if run_dir.recorded_kind() == "sft":  # the kind file, which the manifest has just checked
        return verify_sft_run(RunDir(root, kind="sft"), len(listed))
    orchestrator = run_dir.read_config().orchestrator
    k = orchestrator.max_off_policy_steps
    metrics = run_dir.read_metrics()
    if not metrics:
        raise VerifyError("metrics.jsonl has no step")
    for line in metrics:
        if (distance := trained_distance(line)[0]) > k:
            raise VerifyError(f"step {line.step}: off-policy distance {distance} > k = {k}")
    samples = 0
    for line in metrics:
        batch = run_dir.read_batch(line.step)
        check_groups(run_dir, batch.step, orchestrator.group_size)
        for i, sample in enumerate(batch.samples):
            if sample.turns is not None:
                check_turns(f"step {batch.step}: sample {i}", sample)
            distance = off_policy_distance(batch.step, sample.trained_spans())
            if distance > k:
                raise VerifyError(f"step {batch.step}: sample {i} was trained at off-policy distance {distance} > k = {k}")
        samples += len(batch.samples)
    for line in run_dir.read_evals():
        check_eval(run_dir, line.version)
    final = metrics[-1]
    for worker, version in final.worker_versions.items():
        if version != final.step:
            raise VerifyError(f"worker {worker} ended at version {version}, not the final version {final.step}")
    return (f"{run_dir.root}: {len(listed)} artifacts match the manifest; {len(metrics)} steps, {samples} trained "
            f"samples, max off-policy distance {max(trained_distance(m)[0] for m in metrics)} <= k = {k}; "
            f"{len(final.worker_versions)} worker(s) at the final version {final.step}")


def verify_sft_run(run_dir: RunDir, artifacts: int) -> str:
    """A `fleetrl sft` run's invariants, once its manifest holds: a line per step 1..N and a final model."""
    metrics = run_dir.read_metrics()
    steps = [line.step for line in metrics]
    if steps != list(range(1, len(steps) + 1)) or not steps:
        raise VerifyError(f"metrics.jsonl: steps {steps[:10]} are not 1..N")
    if not (run_dir.final_model_dir / "config.json").is_file():
        raise VerifyError(f"{run_dir.final_model_dir}: no final model (config.json)")
    return (f"{run_dir.root}: {artifacts} artifacts match the manifest; sft: {len(metrics)} steps, loss "
            f"{metrics[0].loss} at step 1, {metrics[-1].loss} at step {len(metrics)}; final_model/ written")


def eval_summary(figures: dict[str, EvalFigures]) -> str:
    """An evaluation's figures in a line: each environment's reward (± its standard error, where
    there is one: none of a single prompt, or in eval.jsonl lines older than it) and pass@1."""
    def reward(f: EvalFigures) -> str:
        return f"{f.reward_mean:.3f}" + (f" ± {f.reward_se:.3f}" if f.reward_se is not None else "")

    return ", ".join(f"{name} reward {reward(f)} pass@1 {f.pass_at[1]:.3f}" if f.reward_mean is not None
                     else f"{name} nothing scored" for name, f in figures.items())


def check_groups(run_dir: RunDir, step: int, group_size: int) -> None:
    """Every group step `step` sampled holds `group_size` samples, trained or dropped (its
    rollouts): a worker's answer with an extra choice once trained as a group of 5 at group
    size 4, its advantages taken over five."""
    sampled = Counter(record.group for record in run_dir.read_rollouts(step))
    if not sampled:
        raise VerifyError(f"step {step}: no rollouts ({run_dir.rollouts_path(step)})")
    for group, size in sorted(sampled.items()):
        if size != group_size:
            raise VerifyError(f"step {step}: group {group} holds {size} samples, not orchestrator.group_size = "
                              f"{group_size}")


def check_eval(run_dir: RunDir, version: int) -> None:
    """Every token an evaluation of `version` scored is of that version."""
    for i, record in enumerate(run_dir.read_eval_records(version)):
        if record.drop_reason is None and {v for v, _ in record.spans} != {version}:
            raise VerifyError(f"the evaluation of v{version}: sample {i} ({record.task}) holds tokens of "
                              f"versions {sorted({v for v, _ in record.spans})}")


def check_turns(where: str, sample: Sample) -> None:
    """A multi-turn sample's version accounting: its model turns lie in order inside the
    completion, each opens a span of its own and no span opens on an environment token, the loss
    sees no environment token, and no turn was sampled by an older policy than the turn before."""
    if sample.loss_mask is None:
        raise VerifyError(f"{where}: has model turns but no loss mask")
    model = [0] * len(sample.completion_ids)
    previous_end = 0
    for start, end in sample.turns:
        if not previous_end <= start < end <= len(sample.completion_ids):
            raise VerifyError(f"{where}: model turn [{start}, {end}) is out of order or outside its "
                              f"{len(sample.completion_ids)} tokens")
        model[start:end] = [1] * (end - start)
        previous_end = end
    starts = {span.start for span in sample.spans}
    if missing := [start for start, _ in sample.turns if start not in starts]:
        raise VerifyError(f"{where}: the model turn at token {missing[0]} opens no version span of its own")
    if stray := [span.start for span in sample.spans if not model[span.start]]:
        raise VerifyError(f"{where}: a version span opens at token {stray[0]}, which the environment wrote")
    if trained := [i for i, (m, t) in enumerate(zip(model, sample.loss_mask)) if t and not m]:
        raise VerifyError(f"{where}: the loss sees token {trained[0]}, which the environment wrote")
    versions = [span.version for span in sample.spans]
    if versions != sorted(versions):
        raise VerifyError(f"{where}: its spans go back in version ({versions}): a later turn by an older policy")


def _first_change(name: str, new, old) -> tuple[str, object, object]:
    """Where two values of config key `name` differ: in a section (the same fields on both
    sides, as trainer.lora has), its first changed field, so the refusal names it."""
    if isinstance(new, dict) and isinstance(old, dict) and new.keys() == old.keys():
        key = next(k for k in new if new[k] != old[k])
        return _first_change(f"{name}.{key}", new[key], old[key])
    return name, new, old
