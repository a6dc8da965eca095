"""What each `fleetrl` command does, once the CLI has parsed it into a config.

Each command's modules are imported when it runs, so `fleetrl --help` and `--dry-run` stay
fast (torch, transformers and the providers are not loaded for them); `rl`, `sft`, `eval` and
`export` import theirs with the garbage collector paused (fleetrl/heavy_imports.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from fleetrl.config import Config
from fleetrl.errors import FleetrlError
from fleetrl.heavy_imports import imports_without_gc
from fleetrl.processes import stop_all


def base_config_files(args: argparse.Namespace) -> list[Path]:
    """The saved config a command starts from, under the command line's own (`@ file.toml`, then
    flags): `fleetrl eval RUN_DIR` the run's config.toml, which an older fleetrl may have written
    (`load_config`'s `saved`); a bad argument is refused here, before anything is loaded."""
    if args.command == "eval":
        from fleetrl.app.eval import config_files

        return config_files(args.model_or_run)
    return []


def check_run_dir(args: argparse.Namespace) -> None:
    """A RUN_DIR argument that is no folder, named as such (not as a run that did not finish)."""
    run_dir = getattr(args, "run_dir", None)
    if run_dir is not None and not run_dir.is_dir():
        raise FleetrlError(f"RUN_DIR {run_dir} {'is not a folder' if run_dir.exists() else 'does not exist'}")


def check_command(args: argparse.Namespace, config: Config) -> None:
    """What a command refuses before it starts anything; `--dry-run` runs it too."""
    check_run_dir(args)
    if args.command == "rl":
        from fleetrl.app.checks import check_config

        check_config(config)
    if args.command == "sft":
        from fleetrl.app.sft import check_sft

        check_sft(config)
    if args.command == "eval":
        from fleetrl.app.eval import plan

        plan(config, args.model_or_run, args.step, args.out)


def run_command(args: argparse.Namespace, config: Config) -> int:
    """Runs `args.command`; every process it started is stopped on the way out, however it ends."""
    # Before torch loads (OpenMP reads it once), for this process and every one it starts (trainer
    # ranks, engines): an OpenMP thread out of work sleeps rather than spins. fleetrl's processes
    # share the CPUs with each other and with the user's other commands (an evaluation beside a
    # warm start), and a spinning thread holds a CPU another one needs (docs/benchmarks.md,
    # "OpenMP threads that sleep"). A user's own setting stands.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        check_run_dir(args)
        return _dispatch(args, config)
    finally:
        stop_all()


def _dispatch(args: argparse.Namespace, config: Config) -> int:
    if args.command == "rl":
        with imports_without_gc():
            from fleetrl.app.rl import RLRun, run_peer_rank
        from fleetrl.torchrun import launched_rank

        launched = launched_rank()
        return run_peer_rank(config) if launched and launched.rank > 0 else RLRun(config).run()
    if args.command == "sft":
        with imports_without_gc():
            from fleetrl.app.sft import SftRun, run_sft_peer_rank
        from fleetrl.torchrun import launched_rank

        launched = launched_rank()
        return run_sft_peer_rank(config) if launched and launched.rank > 0 else SftRun(config).run()
    if args.command == "verify":
        from fleetrl.rundir import verify_run

        if args.run_dir is None:
            raise FleetrlError("fleetrl verify needs a run directory: fleetrl verify RUN_DIR")
        print(verify_run(args.run_dir))
        return 0
    if args.command == "model":
        from fleetrl.model import resolve_model

        print(resolve_model(config.model, log=lambda line: print(line, file=sys.stderr)))  # stdout: the path alone
        return 0
    if args.command == "plot":
        from fleetrl.rundir import plot_run

        if args.run_dir is None:
            raise FleetrlError("fleetrl plot needs a run directory: fleetrl plot RUN_DIR")
        for path in plot_run(args.run_dir):
            print(f"fleetrl plot: wrote {path}")
        return 0
    if args.command == "inference":
        from fleetrl.app.inference import DEFAULT_PROMPTS, run_inference

        return asyncio.run(run_inference(config, args.prompts or DEFAULT_PROMPTS))
    if args.command == "status":
        from fleetrl.app.status import run_status

        return asyncio.run(run_status(config, args.run_dir))
    if args.command == "export":
        with imports_without_gc():
            from fleetrl.app.export import run_export

        if args.run_dir is None or args.out_dir is None:
            raise FleetrlError("fleetrl export needs a run directory and a folder to write: "
                               "fleetrl export RUN_DIR OUT_DIR [--step N] [--adapter]")
        return run_export(args.run_dir, args.out_dir, args.step, adapter_only=args.adapter)
    if args.command == "eval":
        with imports_without_gc():
            from fleetrl.app.eval import run_eval

        return run_eval(config, args.model_or_run, args.step, args.out)
    if args.command == "bench":
        from fleetrl.app.bench import run_bench

        return run_bench(args.suite, args.quick, args.out)
    raise AssertionError(args.command)
