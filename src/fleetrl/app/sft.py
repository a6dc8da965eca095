"""`fleetrl sft`: supervised training of the policy on conversations or prompt/completion pairs
(sft.*), the loss on the assistant's tokens, with `fleetrl rl`'s trainer: its ranks (started
here as `python -m fleetrl.trainer sft`, or by torchrun), LoRA, checkpoints and exact resume,
the step sink (metrics.jsonl of SftLine records, TensorBoard, W&B, the live view), then
RUN_DIR/final_model (a whole Hugging Face folder, a LoRA adapter merged in: a `model.path` for
`fleetrl rl`) and the manifest. No inference worker is started. This process is rank 0 and runs
the training loop on its main thread.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fleetrl import progress
from fleetrl.app.checks import take_world_from_launcher
from fleetrl.app.live import LiveView
from fleetrl.app.rl import check_ranks, find_resume, run_peer, start_trainer_ranks, write_final_model
from fleetrl.config import Config, ConfigError
from fleetrl.errors import FleetrlError
from fleetrl.model import resolve_model
from fleetrl.monitoring import StepSink
from fleetrl.processes import ManagedProcess, install_signal_handlers, stop_groups
from fleetrl.records import SftLine, SftMetrics
from fleetrl.rundir import RunDir
from fleetrl.sft_data import SftData
from fleetrl.trainer import distributed
from fleetrl.trainer.sft import NamedTensors, train_sft, train_sft_peer


def check_sft(config: Config, log=print) -> tuple[Path, SftData]:
    """What `fleetrl sft` (and its --dry-run) refuses before anything starts: the config, and
    every row of the data rendered in the policy's chat template; the model folder and the data."""
    take_world_from_launcher(config)
    if config.sft.max_tokens > config.trainer.micro_batch_tokens:
        raise ConfigError(f"sft.max_tokens = {config.sft.max_tokens} is more than trainer.micro_batch_tokens = "
                          f"{config.trainer.micro_batch_tokens}: a row must fit one micro-batch")
    from transformers import AutoTokenizer

    model_dir = resolve_model(config.model, log=log)
    data = SftData(config.sft, AutoTokenizer.from_pretrained(model_dir), config.run.seed)
    data.check()
    return model_dir, data


class SftRun:
    """One `fleetrl sft` job; `stop` ends what `run` started, however far it got."""

    def __init__(self, config: Config, log=print) -> None:
        self.config = config
        self.log = log
        self.run_dir = RunDir(config.run.dir, log=log, kind="sft")
        self.model_dir: Path | None = None
        self.view: LiveView | None = None
        self.sink: StepSink | None = None
        self.ranks: list[ManagedProcess] = []  # trainer ranks 1..N-1, as children
        self.ranks_stopped = threading.Event()  # set as the stop begins: the ranks' watch ends (`watch_ranks`)

    def run(self) -> int:
        install_signal_handlers()  # a SIGTERM of fleetrl stops the ranks too
        if self.config.run.live_view == "off":
            progress.set_interactive(False)
        try:
            # Everything is checked before the run directory is touched.
            self.model_dir, data = check_sft(self.config, self.log)
            resume = find_resume(self.run_dir, self.log)
            if progress.interactive():
                self.view = LiveView(self.config.run.max_steps, resume, self.config.sft.sequences_per_step)
                self.view.start()
            self.run_dir.start(self.config, resume, inputs={"model.path": self.model_dir, "sft.path": data.path})
            self.sink = StepSink(self.config, self.run_dir, self.view, log=self.log)
            world = start_trainer_ranks(self.config, self.run_dir, self.model_dir, "sft", self.ranks,
                                        self.ranks_stopped)
            self.log(f"fleetrl: sft run {self.run_dir.root}: {self.config.run.max_steps} steps of "
                     f"{self.config.sft.sequences_per_step} of the {len(data)} rows of {data.path}, "
                     f"{self.config.trainer.world_size} trainer rank(s)"
                     + (f", resuming after step {resume}" if resume else ""))
            try:
                train_sft(self.config, self.run_dir, self.model_dir, world, data.step_sequences, self.on_step,
                          self.write_final, log=self.log)
            except FleetrlError:
                raise
            except Exception:
                self.wait_for_a_dead_rank()  # a collective fails when a peer rank dies: name the rank
                raise
            self.sink.close()  # its files complete before the manifest lists them
            self.run_dir.write_manifest()
            self.log(f"fleetrl: done: {self.run_dir.root} (its final model: {self.run_dir.final_model_dir})")
            return 0
        finally:
            self.stop()

    def on_step(self, metrics: SftMetrics, started: float, finished: float) -> None:
        self.sink.write_sft(SftLine(**metrics.model_dump(), train_started=started, train_finished=finished))

    def write_final(self, named: NamedTensors) -> None:
        if self.view is not None:
            self.view.set_phase("writing the final model")
        # Version 0: no policy has been trained by RL yet, and `fleetrl rl` on it starts at v0.
        write_final_model(self.config, self.run_dir, self.model_dir, named, 0, self.log,
                          what=f"step {self.config.run.max_steps}, version 0 of an RL run started from it")

    def wait_for_a_dead_rank(self) -> None:
        deadline = time.monotonic() + 5  # a rank that failed takes a moment to exit
        while self.ranks and all(r.alive() for r in self.ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        check_ranks(self.ranks)

    def stop(self) -> None:
        self.ranks_stopped.set()
        if self.sink is not None:
            self.sink.close()
        distributed.destroy()
        stop_groups(self.ranks)
        self.run_dir.close()  # last: the directory is this run's until everything it started is gone
        if self.view is not None:
            self.view.stop()


def run_sft_peer_rank(config: Config) -> int:
    """`fleetrl sft` as a rank other than 0 of a group torchrun started: a trainer rank only (`run_peer`)."""
    take_world_from_launcher(config)
    return run_peer(config, "sft", train_sft_peer)
