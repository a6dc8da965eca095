"""`fleetrl rl`: the fleet, the trainer ranks and the orchestrator, started and ended together.

Process layout: this process is trainer rank 0 and hosts the control side — the fleet
coordinator and the orchestrator run on an asyncio loop in a background thread (the control
loop), the training loop in the main thread. Trainer ranks 1..N-1 are child processes; the
inference workers are child processes (or attached servers). Rank 0 is the broadcast sender,
so publishing a version is a call from the training loop into the coordinator in the same
process: the publish fence never spans a process boundary.

Under torchrun (or any launcher that sets its variables, `fleetrl.torchrun`) every rank is a
`fleetrl rl` process, possibly on another node: global rank 0 is all of the above and starts no
rank; the others run `run_peer_rank`, trainer ranks only, once they have checked that they see
the run directory and the model folder rank 0 uses (shared storage).

The main thread reads the fleet only through the control loop (`ControlLoop.run`), the one
thread that changes it.

Everything started here is stopped on success, on the failure of any part, and on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from fleetrl import progress
from fleetrl.app.checks import check_config, check_prompts_fit
from fleetrl.app.live import LiveView
from fleetrl.app.orchestration import build_evaluator, build_orchestrator
from fleetrl.app.providers import build_fleet, build_transport, start_recorded, start_source
from fleetrl.batch import Batch
from fleetrl.config import Config
from fleetrl.cores import format_cpus, plan_cores
from fleetrl.envs.mix import RunEnv
from fleetrl.errors import FleetrlError
from fleetrl.files import sha256_file
from fleetrl.inference.fleet import AgreementProbe, Fleet, WeightSource
from fleetrl.inference.provider import NamedTensors, WeightTransport
from fleetrl.inference.types import GenerateRequest, SamplingParams
from fleetrl.model import resolve_model
from fleetrl.monitoring import StepSink
from fleetrl.orchestrator.chat import render_prompt
from fleetrl.orchestrator.evaluation import Evaluator
from fleetrl.orchestrator.rollouts import Orchestrator
from fleetrl.processes import (KILL_WAIT_S, STOP_BOUND_S, STOP_GRACE_S, STOP_WAITS_S, ManagedProcess, at_forced_exit,
                                cancel_at_forced_exit, exit_now, free_port, install_signal_handlers, main_thread_at,
                                start_process, stop_all, stop_groups, stop_signal, stopping, stop_time_left)
from fleetrl.records import (EvalFigures, FinalProbe, FinalRecord, FinalWorker, PublishReport, StepLine, StepMetrics,
                             TrainEvent)
from fleetrl.rundir import RunDir
from fleetrl.torchrun import launched_rank
from fleetrl.trainer import checkpoint, distributed
from fleetrl.trainer.export import export_weights
from fleetrl.trainer.gather import WeightGather
from fleetrl.trainer.loop import Hooks, Snapshot, train, train_peer
from fleetrl.trainer.lora import adapter_config


# A stop slower than SLOW_STOP_S says how long it took (its waits are bounded: `RLRun.stop`).
SLOW_STOP_S = 3.0
# How long the main thread has to stop for a trainer rank's death itself (`watch_ranks`): a
# collective with a dead peer fails at once, as a rule, and the waits between collectives check.
DEAD_RANK_GRACE_S = 10.0


class ControlLoop:
    """An asyncio loop in a daemon thread, for the fleet and the orchestrator. Every wait on it
    also watches the thread: a loop that ended (what escaped a task, a SystemExit say) fails the
    wait with one line instead of hanging the run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ended_by: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="fleetrl-control", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run_forever()
        except BaseException as e:  # escaped a task: the loop is gone; `check` names it
            self.ended_by = e

    def check(self) -> None:
        """Raises if the loop's thread has ended."""
        if not self.thread.is_alive():
            why = f": {type(self.ended_by).__name__}: {self.ended_by}" if self.ended_by is not None else ""
            raise FleetrlError(f"the control loop (the fleet and the rollouts) has ended{why}")

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout_s: float | None = None):
        return self.wait(self.submit(coro), timeout_s)

    def wait(self, future: Future, timeout_s: float | None = None):
        """`future.result()`, checking every second that the loop still runs; after `timeout_s`
        (None: no bound) the coroutine is cancelled and TimeoutError raised."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return future.result(timeout=1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic())))
            except TimeoutError:
                if future.done():
                    raise  # the coroutine's own TimeoutError
                self.check()
                if deadline is not None and time.monotonic() >= deadline:
                    future.cancel()
                    raise

    def stop(self, timeout_s: float = STOP_BOUND_S) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=timeout_s)


class RLRun:
    """One `fleetrl rl` job: `run()` reads top-down; the hooks below are what the training
    loop calls back."""

    def __init__(self, config: Config, log=print) -> None:
        """Every component of the run, declared here and built by `run` in order; `stop` ends
        those that were built, however far `run` got."""
        self.config = config
        self.log = log
        self.run_dir = RunDir(config.run.dir, log=log)
        self.resume = 0  # the step of the checkpoint to resume from (`find_resume`)
        self.control = ControlLoop()  # the thread of the fleet and the orchestrator
        self.view: LiveView | None = None  # on a terminal
        self.model_dir: Path | None = None  # the model folder every trainer rank and launched worker loads
        self.tokenizer = None  # the model's (transformers)
        self.sink: StepSink | None = None  # where each step's line goes, once the run directory is started
        self.transport: WeightTransport | None = None
        self.orchestrator: Orchestrator | None = None
        self.evaluator: Evaluator | None = None  # with eval.every_steps
        self.fleet: Fleet | None = None  # once set, stop() closes it and the transport
        self.fleet_started: Future | None = None  # the fleet's start, on the control loop
        self.ranks: list[ManagedProcess] = []  # trainer ranks 1..N-1, as children
        self.ranks_stopped = threading.Event()  # set as the stop begins: the ranks' watch ends (`watch_ranks`)
        self.world = None  # this process's place in the trainer group (trainer/distributed.py)
        self.rollouts: list[Future] = []  # the orchestrator's run, on the control loop
        self.watching: Future | None = None  # the view's copy of the fleet's state, on the control loop
        # The weights attached workers start from (`hand_start_weights`): the base, or the
        # checkpoint's the run resumes from, put by the training loop once it has loaded them,
        # taken by the fleet's start on the control loop (`take_start_weights`), which keeps them
        # only until the first publish replaces them; None: the run stopped first.
        self.start_weights: queue.Queue[WeightSource | None] = queue.Queue(maxsize=1)
        # The last version's probe, and its weights where they are kept (a CPU snapshot; on CUDA none
        # is: the final model was written while the ranks gathered the last version, see publish).
        self.published: tuple[Snapshot | None, AgreementProbe] | None = None
        # Each evaluation's figures by version, until its step's line.
        self.evaluated: dict[int, dict[str, EvalFigures]] = {}

    def run(self) -> int:
        # Also with one rank, where every process starts on the control loop's thread: a SIGTERM
        # of fleetrl must stop the workers (Ctrl-C and exit are handled either way).
        install_signal_handlers()
        if self.config.run.live_view == "off":
            progress.set_interactive(False)
        try:
            # Everything is checked before the run directory is touched (locked, created, its
            # checkpoints read): a refused command leaves a finished run as it was (`fleetrl
            # verify` still passes on it), and no directory where there was none.
            envs, evaluated = check_config(self.config)
            if self.config.run.core_plan != "off":
                apply_core_plan(self.config, self.log)
            # Labelled with this RunDir's run id: the one its start writes (a new run's is drawn here).
            self.model_dir = resolve_model(self.config.model)
            fleet = build_fleet(self.config, self.run_dir, self.model_dir, adapter=self.config.trainer.lora.spec)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            check_prompts_fit(self.config, envs, self.tokenizer)
            self.resume = find_resume(self.run_dir, self.log)
            if progress.interactive():
                orchestrator = self.config.orchestrator
                self.view = LiveView(self.config.run.max_steps, self.resume,
                                     orchestrator.batch_prompts * orchestrator.group_size)
                self.view.start()
            self.run_dir.start(self.config, self.resume, inputs={"model.path": self.model_dir})
            self.sink = StepSink(self.config, self.run_dir, self.view, log=self.log)
            self.start_fleet(fleet, envs, evaluated)
            self.start_ranks()
            self.log(f"fleetrl: run {self.run_dir.root}: {self.config.run.max_steps} steps, "
                     f"k = {self.config.orchestrator.max_off_policy_steps}, {self.config.trainer.world_size} "
                     f"trainer rank(s), env {', '.join(e.name for e in envs)}" + (f", resuming after step {self.resume}" if self.resume else ""))
            self.train()
            self.finish()
            return 0
        finally:
            self.stop()

    def start_fleet(self, fleet: Fleet, envs: list[RunEnv], evaluated: list[RunEnv]) -> None:
        """Builds the weight transport, the orchestrator and the evaluator; the fleet starts on
        the control loop while the trainer ranks start here."""
        config = self.config
        # A LoRA run publishes its adapter alone (trainer/lora.py), into the workers' adapter.
        self.transport = build_transport(config, self.run_dir, "adapter" if config.trainer.lora.enabled else "model")
        self.orchestrator = build_orchestrator(config, fleet, envs, self.tokenizer, self.run_dir, self.log)
        if evaluated:
            self.evaluator = build_evaluator(config, self.orchestrator, evaluated, self.run_dir, self.log)
        self.fleet = fleet  # from here on, stop() closes it and the transport
        at_forced_exit(self.run_dir.forget_fleet)  # its tokens never outlive the run, however it ends
        fleet.on_event = self.run_dir.append_event  # worker states and fences, for the timeline
        # The same check as the training loop's, which hands the start weights (trainer/loop.py).
        weights = self.take_start_weights if config.inference.attaches() else None
        self.fleet_started = self.control.submit(start_recorded(fleet, self.run_dir, weights))
        if self.view is not None:
            self.watching = self.control.submit(self.view.watch(fleet, self.orchestrator))

    def start_ranks(self) -> None:
        self.world = start_trainer_ranks(self.config, self.run_dir, self.model_dir, "rl", self.ranks,
                                         self.ranks_stopped)

    def train(self) -> None:
        hooks = Hooks(wait_batch=self.wait_batch, start_rollouts=self.start_rollouts, publish=self.publish,
                      start_weights=self.hand_start_weights, on_step=self.on_step)
        try:
            train(self.config, self.run_dir, self.model_dir, self.world, hooks, log=self.log)
        except FleetrlError:
            raise  # the loop's own verdict (a step that is not finite, a publish that reached no one)
        except Exception:
            # A collective fails when a peer rank dies: name the rank rather than gloo's error,
            # unless fleetrl was told to stop and stopped it. Then the run ends as the signal's
            # handler ends it, whose own exception torch may have dropped while the collective
            # waited (a SIGTERM mid-step ended "trainer-rank-1 died (exit code -9)").
            if (signum := stop_signal()) is not None:
                raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
            deadline = time.monotonic() + 5
            while self.ranks and all(r.alive() for r in self.ranks) and time.monotonic() < deadline:
                time.sleep(0.1)
            self.check_children()
            raise

    def finish(self) -> None:
        weights, probe = self.published
        self.run_dir.write_final(self.control.run(final_generation(self.fleet, self.tokenizer, probe)))
        if weights is not None:
            self.write_final_model(lambda: iter(weights.items()))
        self.run_dir.write_plots()
        self.sink.close()  # its files complete before the manifest lists them
        self.run_dir.write_manifest()
        self.log(f"fleetrl: done: {self.run_dir.root} (check it with `fleetrl verify {self.run_dir.root}`)")

    def stop(self) -> None:
        """Every wait here ends by one deadline (`stop_time_left`): after a SIGTERM or SIGINT,
        before the watchdog's exit would cut the stop short of its last steps (the fleet's
        record and tokens removed, the metrics written, the directory let go)."""
        began = time.monotonic()
        self.ranks_stopped.set()
        try:
            self.start_weights.put_nowait(None)  # a fleet start still waiting for its weights gives up
        except queue.Full:
            pass
        for future in self.rollouts + [f for f in (self.watching, self.fleet_started) if f is not None]:
            future.cancel()
        if self.fleet is not None and self.control.thread.is_alive():  # else the exit's stop_all ends its processes
            try:
                self.control.run(_close(self.fleet, self.transport), timeout_s=stop_time_left(began))
            except TimeoutError:
                self.log(f"fleetrl: the fleet did not close within {STOP_WAITS_S:.0f} s of the stop or the signal: "
                         "stopping its processes")
                stop_all()  # before the run directory is let go: no worker of this run outlives its lock
        if self.fleet is not None:
            self.run_dir.forget_fleet()
            cancel_at_forced_exit(self.run_dir.forget_fleet)
        self.control.stop(timeout_s=stop_time_left(began))
        if self.sink is not None:
            self.sink.close()
        distributed.destroy()
        stop_groups(self.ranks, grace_s=min(STOP_GRACE_S, max(0.0, stop_time_left(began) - KILL_WAIT_S)))  # together
        self.run_dir.close()  # last: the directory is this run's until everything it started is gone
        if self.view is not None:
            self.view.stop()
        if (took := time.monotonic() - began) > SLOW_STOP_S:  # what a user waited for, and where to look
            self.log(f"fleetrl: stopping took {took:.1f} s")

    # -- what the training loop calls ------------------------------------------------------

    def hand_start_weights(self, version: int, weights: Snapshot, probe_ids: list[int],
                           reference: list[float]) -> None:
        """The weights of `version` the run starts from (the base, or a resumed checkpoint's),
        from the trainer's own copy, for the fleet's start to hold attached workers to
        (`Fleet.start`); until the first publish, they are also the ones the fleet serves."""
        probe = AgreementProbe(probe_ids, reference)
        self.published = weights, probe
        self.start_weights.put(start_source(self.transport, weights, probe, version))

    async def take_start_weights(self) -> WeightSource:
        """What `Fleet.start` holds attached workers to (waited for, off the event loop, until the
        trainer has loaded them); nothing here keeps them after."""
        source = await asyncio.to_thread(self.start_weights.get)
        if source is None:
            raise FleetrlError("the run stopped before the trainer handed the fleet the weights it starts from")
        return source

    def wait_batch(self, step: int) -> Batch:
        self.phase(f"waiting for batch {step}")
        batch = self.run_dir.wait_batch(step, while_waiting=self.check_children)
        self.phase(f"training step {step}")
        return batch

    def phase(self, what: str) -> None:
        if self.view is not None:
            self.view.set_phase(what)

    def start_rollouts(self, start: int) -> None:
        """The fleet serves version `start` now, and nothing samples yet: the evaluation of the
        version the run starts from (no step's line follows it, so it is charted here)."""
        self.wait_fleet()
        if self.evaluator and self.evaluator.due(start, start=True):
            self.sink.write_eval(start, self.evaluate(start))
        self.rollouts.append(self.control.submit(self.orchestrator.run(start + 1, self.config.run.max_steps)))

    def publish(self, step: int, weights: Snapshot | WeightGather, probe_ids: list[int],
                reference: list[float]) -> PublishReport:
        """A CPU snapshot is published and kept (refits, the final model). A gather (CUDA) is
        valid only during this call, while the other ranks serve it: the fleet keeps nothing to
        refit from, and the last version's final model is written here, from one more gather.
        A rolling publish returns once its canary agreed, except the run's last, one to be
        evaluated, and a resumed run's first, which reach every worker first: launched workers
        start at the base model, and each must hold the checkpoint's version before it samples."""
        self.wait_fleet()
        self.phase(f"publishing v{step}")
        probe = AgreementProbe(probe_ids, reference)
        gathered = isinstance(weights, WeightGather)
        named = weights.tensors if gathered else lambda: iter(weights.items())
        evaluated = bool(self.evaluator and step > self.resume and self.evaluator.due(step))
        everywhere = step in (self.config.run.max_steps, self.resume) or evaluated
        report = self.control.run(self.fleet.publish(step, self.transport, named, probe, keep=not gathered,
                                                     everywhere=everywhere))
        if not report.ready:
            raise FleetrlError(f"publish v{step} reached no worker")
        self.published = (None if gathered else weights), probe
        if gathered and step == self.config.run.max_steps:
            self.write_final_model(weights.tensors)
        # A resumed run publishes its checkpoint's version again, for no step's line: start_rollouts
        # evaluates that one.
        if evaluated:
            self.evaluated[step] = self.evaluate(step)
        return report

    def evaluate(self, version: int) -> dict[str, EvalFigures]:
        """The evaluation of `version`, which the fleet serves: the trainer waits in its publish
        hook meanwhile, so no other version is published until it is done."""
        self.phase(f"evaluating v{version}")
        return self.control.run(self.evaluator.evaluate(version))

    def write_final_model(self, named: NamedTensors) -> None:
        write_final_model(self.config, self.run_dir, self.model_dir, named, self.fleet.version, self.log)

    def on_step(self, batch: Batch, metrics: StepMetrics, report: PublishReport, started: float,
                finished: float) -> None:
        self.run_dir.append_event(TrainEvent(step=batch.step, start=started, end=finished))
        self.sink.write(StepLine(step=batch.step, batch=batch.meta, update=metrics, publish=report,
                                 eval=self.evaluated.pop(batch.step, None),
                                 worker_versions=self.control.run(ready_versions(self.fleet)),
                                 train_started=started, train_finished=finished))
        self.phase(f"step {batch.step} published")

    # -- failures of the other parts -------------------------------------------------------

    def check_children(self) -> None:
        """Raises the failure of a trainer rank, the fleet's start or the rollouts, if any."""
        self.control.check()
        check_ranks(self.ranks)
        for future in self.rollouts + ([self.fleet_started] if self.fleet_started else []):
            if future.done() and future.exception():
                raise future.exception()

    def wait_fleet(self) -> None:
        while not self.fleet_started.done():
            self.check_children()
            time.sleep(0.2)
        self.fleet_started.result()


def check_ranks(ranks: list[ManagedProcess]) -> None:
    """Raise the death of the first trainer rank (of `fleetrl rl`'s or `fleetrl sft`'s) that died, in one line."""
    for rank in ranks:
        if not rank.alive():
            raise FleetrlError(death_of(rank))


def death_of(rank: ManagedProcess) -> str:
    return f"{rank.name} died (exit code {rank.popen.returncode}); last lines of {rank.log_path}: {rank.log_tail(3)}"


def watch_ranks(ranks: list[ManagedProcess], stopped: threading.Event, grace_s: float = DEAD_RANK_GRACE_S) -> None:
    """Watch trainer ranks 1..N-1 from a thread of their own until `stopped` is set (the
    command's stop has begun). A collective fails when a peer rank dies, and the main thread then
    names the rank (`check_ranks`); but gloo can miss the death of a peer that died between an
    all-gather's send and its receive, and wait out the collective's timeout (up to an hour:
    `collective_timeout_s`) in a call that nothing interrupts. A rank that ended with an error
    and that the main thread has not stopped for within `grace_s` ends fleetrl from here
    (`exit_now`), with the line the main thread would have printed. A rank that exits 0 has
    finished its training; one ended by fleetrl's own stop (`stopping`) is no error."""
    def watch() -> None:
        while not stopped.wait(0.5) and not stopping():
            dead = next((r for r in ranks if r.popen.poll() not in (None, 0)), None)
            if dead is None:
                continue
            if stopped.wait(grace_s) or stopping():
                return
            exit_now(1, f"fleetrl: {grace_s:.0f} s after {dead.name} died, the main thread still waits in "
                        f"{main_thread_at()} (a collective that missed the death): its processes are stopped\n"
                        f"fleetrl: error: {death_of(dead)}")

    threading.Thread(target=watch, name="fleetrl-rank-watch", daemon=True).start()


def start_trainer_ranks(config: Config, run_dir: RunDir, model_dir: Path, mode: str, ranks: list[ManagedProcess],
                        stopped: threading.Event) -> distributed.World:
    """This process's place in the trainer group, once ranks 1..N-1 are started as children
    (`python -m fleetrl.trainer MODE ...`, added to `ranks`, watched until `stopped`:
    `watch_ranks`) unless a launcher started them. The rendezvous is handed to each rank, never
    written into this process's environment: os.environ is process-wide, and the control loop
    starts workers meanwhile (`start_process` copies it), which must neither see it change under
    the copy nor inherit a trainer rank's variables."""
    world_size = config.trainer.world_size
    launched = launched_rank() is not None
    rendezvous = None
    if world_size > 1 and not launched:
        group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1")),
                 "WORLD_SIZE": str(world_size)}
        rendezvous = {**group, "RANK": "0", "LOCAL_RANK": "0"}
        ranks += [
            start_process(f"trainer-rank-{rank}",
                          [sys.executable, "-m", "fleetrl.trainer", mode, str(run_dir.root), str(model_dir)],
                          run_dir.log_path(f"trainer-rank-{rank}"),
                          env={**group, "RANK": str(rank), "LOCAL_RANK": str(rank)})
            for rank in range(1, world_size)
        ]
        watch_ranks(ranks, stopped)  # from here: a rank that dies in the rendezvous too
    world = distributed.init(distributed.collective_timeout_s(config), rendezvous)
    if launched:  # what the peers must see as rank 0 does (check_sees_rank0)
        distributed.broadcast_from_rank0({"config_sha256": sha256_file(run_dir.config_path),
                                          "model_dir": str(model_dir)})
    distributed.use_cpus(config.trainer.cpu_cores, world)
    return world


def write_final_model(config: Config, run_dir: RunDir, model_dir: Path, named: NamedTensors, version: int,
                      log=print, what: str = "") -> None:
    """RUN_DIR/final_model: the full tensors `named` gives (`trainer.model.named_tensors`'s), of
    policy `version` (recorded in the folder for `fleetrl eval`), with the base model's files;
    `what` says in the log line what the version means, where `v{version}` alone would mislead."""
    log(f"fleetrl: writing the final model ({what or f'v{version}'}) to {run_dir.final_model_dir}")
    # A LoRA run's weights are its adapter alone: merged into the base, the folder loads with no peft.
    adapter = adapter_config(config.trainer.lora, model_dir)
    run_dir.replace_final_model(lambda folder: export_weights(model_dir, named(), folder, version, adapter=adapter))


def find_resume(run_dir: RunDir, log=print) -> int:
    """The step to resume from (0: none), `fleetrl rl`'s or `fleetrl sft`'s: the latest good
    checkpoint, read with the run directory already locked, so no other run can add or replace
    one under the decision (a directory that does not exist yet holds none: `RunDir.start`
    creates and locks it once all is checked); a directory of the other kind of run is refused."""
    if run_dir.root.is_dir():
        run_dir.lock()
    try:
        run_dir.check_kind()
        latest = checkpoint.latest(run_dir.checkpoints_dir, log=log)
    except BaseException:
        run_dir.close()
        raise
    return latest[0] if latest else 0


def run_peer_rank(config: Config) -> int:
    """`fleetrl rl` as a rank other than 0 of a group torchrun started: a trainer rank and
    nothing else (`run_peer`)."""
    check_config(config)
    return run_peer(config, "rl", train_peer)


def run_peer(config: Config, kind: str, train_rank: Callable) -> int:
    """A rank other than 0 of a `fleetrl rl` or `fleetrl sft` (`kind`) group torchrun started:
    `train_rank(config, run_dir, model_dir, world)`. It trains with the run directory's config.toml,
    as rank 0 wrote it; a rank that does not see that file, or the model folder, is on storage
    rank 0 does not share."""
    world = distributed.init(timeout_s=distributed.collective_timeout_s(config))
    try:
        rank0 = distributed.broadcast_from_rank0(None)  # sent once rank 0 has started the run directory
        run_dir = RunDir(config.run.dir, kind=kind)
        model_dir = check_sees_rank0(run_dir, rank0, f"trainer rank {world.rank} on {socket.gethostname()}")
        train_rank(run_dir.read_config(), run_dir, model_dir, world)
    finally:
        distributed.destroy()
    return 0


def check_sees_rank0(run_dir: RunDir, rank0: dict, where: str) -> Path:
    """The model folder rank 0 loads, once this rank has checked that it sees the same run
    directory (the config.toml rank 0 wrote, by its sha256) and that folder."""
    if not run_dir.config_path.exists() or sha256_file(run_dir.config_path) != rank0["config_sha256"]:
        raise FleetrlError(f"{where} does not see the run directory rank 0 writes ({run_dir.root}: its config.toml "
                           "is missing or another one): every trainer rank needs run.dir on shared storage")
    model_dir = Path(rank0["model_dir"])
    if not (model_dir / "config.json").exists():
        raise FleetrlError(f"{where} does not see the model folder {model_dir} that rank 0 loads: put it on "
                           "shared storage (model.path) or at the same path on every node")
    return model_dir


def apply_core_plan(config: Config, log=print) -> None:
    """`run.core_plan`: CPUs of their own (`cores.plan_cores`, beside the trainer ranks on this
    machine) for the workers fleetrl launches, when there are two or more ("workers"), and, with
    "auto", for the trainer ranks too. Written into the config where the user set none, so the
    launchers and every rank (which read config.toml) apply them."""
    inference = config.inference
    # prefill_workers is 0 unless the provider is Dynamo (the config refuses it otherwise)
    launched = 0 if inference.attaches() else inference.workers + inference.dynamo.prefill_workers
    pin_ranks = config.run.core_plan == "auto"
    if not pin_ranks and launched < 2:
        return  # one worker: the OS places it beside the ranks, as it would two
    torchrun = launched_rank()
    local_ranks = torchrun.local_world_size if torchrun else config.trainer.world_size
    plan = plan_cores(sorted(os.sched_getaffinity(0)), launched, local_ranks)
    inference.vllm.omp_threads_bind = inference.vllm.omp_threads_bind or plan.workers
    if pin_ranks:
        config.trainer.cpu_cores = config.trainer.cpu_cores or plan.ranks
    log("fleetrl: core plan: " + "; ".join(
        [*(f"worker {i} on CPU {format_cpus(inference.vllm.engine_cpus(i))}" for i in range(launched)),
         *(f"trainer rank {r} on CPU {config.trainer.cpu_cores[r % len(config.trainer.cpu_cores)]}"
           for r in range(config.trainer.world_size) if config.trainer.cpu_cores)]))


async def ready_versions(fleet: Fleet) -> dict[str, int]:
    """Every ready worker's version (on the control loop: the thread that changes the fleet)."""
    return {w.id: w.version for w in fleet.ready_workers()}


async def final_generation(fleet: Fleet, tokenizer, probe: AgreementProbe) -> FinalRecord:
    """final.json: a 16-token greedy sample from the final policy, every worker's version, and
    `probe`, the final version's; each worker checks that all its ranks hold the weights of the
    trainer's last checksum (at the base model of launched workers: that none has received any)."""
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Write one sentence about the sea."}])
    (out,) = await fleet.generate(GenerateRequest(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)))
    workers = {}
    for worker in fleet.ready_workers():
        admin = fleet.provider.admin(worker)
        await admin.verify_weights(fleet.checksum)
        workers[worker.id] = FinalWorker(role=worker.role.value, version=await admin.version(), checksum=fleet.checksum)
    return FinalRecord(version=fleet.version, tokens=out.token_ids, text=tokenizer.decode(out.token_ids),
                       spans=[[s.version, s.start] for s in out.spans], workers=workers,
                       probe=FinalProbe(token_ids=probe.token_ids, trainer_logprobs=probe.logprobs))


async def _close(fleet: Fleet, transport) -> None:
    # The fleet first: a rolling publish's background wave still sends through the transport.
    try:
        await fleet.close()
    finally:
        await transport.close()
