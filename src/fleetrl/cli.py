"""`fleetrl <command> [@ config.toml ...] [--section.key value ...] [--dry-run] [--debug]`.

This module only parses the command line and reports errors: errors the user can act on
print as one line and exit 1 (`--debug` shows the traceback); Ctrl-C exits 130. What each
command does is in fleetrl.app.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from fleetrl.app.bench import SUITE_CHOICES, SUITES
from fleetrl.app.commands import check_command, run_command
from fleetrl.config import ConfigError, field_docs, load_config, to_toml
from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV
from fleetrl.errors import FleetrlError

COMMANDS = {
    "rl": "Run an RL job: fleet, trainer ranks and orchestrator.",
    "inference": "Start the inference fleet, sample a few completions, print them and shut down.",
    "status": "Show each worker of a fleet (a running run's, or the one the config names): role, state, "
              "policy version, weight checksum, requests in flight, last publish; for a finished run, how it left them.",
    "verify": "Re-check a finished run directory's manifest and invariants.",
    "plot": "Draw a run's plots (reward.png, off_policy.png, the version timeline timeline.png, and eval.png "
            "when it evaluates) from its metrics, events and evaluations, while it runs or after.",
    "export": "Write a run's checkpoint (the newest complete one, or --step N) as a Hugging Face folder.",
    "model": "Print the policy model's folder (model.path, or the embedded default, converted once into the "
             "cache): what a server you start yourself serves (`--model \"$(fleetrl model)\"`).",
    "bench": "Run the benchmark suites of benchmarks/ (from a source checkout): print their ratios, "
             "write them to a JSON file.",
}

# Secrets a flag can set, and the variable to export instead: every local user can read a
# process's command line (ps, /proc/PID/cmdline), none can read its environment.
SECRET_FLAGS = {"inference.admin_token": ADMIN_TOKEN_ENV, "inference.data_token": DATA_TOKEN_ENV}

# The commands that take a run directory as their one positional argument.
RUN_DIR_COMMANDS = {
    "verify": "The run directory to check.",
    "status": "A run's directory: a running run's fleet and admin token are read from it; a finished run's "
              "final state is shown.",
    "export": "The run directory whose checkpoint to export.",
    "plot": "The run directory to draw the plots of (into it).",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetrl",
        description="Asynchronous RL against a fleet of inference workers, with per-token policy versions.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub = commands.add_parser(
            name, help=help_text, description=help_text, allow_abbrev=False,
            usage=f"fleetrl {name}{' [RUN_DIR]' if name in RUN_DIR_COMMANDS else ''}"
                  f"{' OUT_DIR' if name == 'export' else ''} [@ CONFIG.toml ...] "
                  "[--SECTION.KEY VALUE ...] [options]",
        )
        sub.add_argument("--dry-run", action="store_true", help="Print the resolved config and exit.")
        sub.add_argument("--debug", action="store_true", help="Show tracebacks on errors.")
        if name in RUN_DIR_COMMANDS:
            sub.add_argument("run_dir", nargs="?", type=Path, help=RUN_DIR_COMMANDS[name])
        if name == "inference":
            sub.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                             help="A prompt to send (repeatable); default: three short questions.")
        if name == "export":
            sub.add_argument("out_dir", nargs="?", type=Path, metavar="OUT_DIR",
                             help="The Hugging Face folder to write (it must not exist).")
            sub.add_argument("--step", type=int, help="The checkpoint's step [default: the newest complete one].")
        if name == "bench":
            sub.add_argument("--suite", choices=SUITE_CHOICES, default="all",
                             help="Which suite: " + "; ".join(f"{n}: {s.measures}" for n, s in SUITES.items())
                             + " [default: all]")
            sub.add_argument("--quick", action="store_true",
                             help="Fewer repetitions and shorter runs: a smoke run, not figures to record.")
            sub.add_argument("--out", type=Path, default=Path("bench.json"),
                             help="Where the results go [default: bench.json].")
        group = sub.add_argument_group("config (TOML files with `@ file.toml`, then these flags)")
        for dotted, description, default in field_docs():
            group.add_argument(f"--{dotted}", dest=f"cfg:{dotted}", metavar="VALUE",
                               default=argparse.SUPPRESS, help=f"{description} [default: {default}]")
    return parser


def is_dotted_flag(arg: str) -> bool:
    """`--section.key` or `--section.key=value`: a config field set on the command line."""
    return arg.startswith("--") and "." in arg.split("=", 1)[0]


def join_dotted_values(argv: list[str]) -> list[str]:
    """`--section.key VALUE` -> `--section.key=VALUE`, whatever VALUE begins with.

    argparse reads an argument that starts with "-" as an option, so a token such as `-x3f`
    or a value `-1` would be refused as a missing value; joined, it is the flag's value.
    """
    out = []
    it = iter(argv)
    for arg in it:
        if is_dotted_flag(arg) and "=" not in arg:
            value = next(it, None)
            arg = arg if value is None else f"{arg}={value}"
        out.append(arg)
    return out


def split_config_files(argv: list[str]) -> tuple[list[str], list[Path]]:
    """Pull `@ file.toml` and `@file.toml` out of argv."""
    rest, files = [], []
    it = iter(argv)
    for arg in it:
        if arg == "@":
            path = next(it, None)
            if path is None:
                raise ConfigError("`@` must be followed by a config file path")
            files.append(Path(path))
        elif arg.startswith("@") and len(arg) > 1:
            files.append(Path(arg[1:]))
        else:
            rest.append(arg)
    return rest, files


def unknown_dotted_flags(unknown: list[str], parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    pairs = []
    for arg in unknown:
        if not is_dotted_flag(arg):
            parser.error(f"unrecognized argument: {arg}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            parser.error(f"argument --{key}: expected one argument")
        pairs.append((key, value))
    return pairs


def keep_logging_as_it_is() -> None:
    """Gives the root logger Python's own last-resort handler (warnings and errors, as bare lines
    on stderr: what an unconfigured process prints), here on the main thread before any command
    starts a thread. A root logger with a handler is one that `logging.basicConfig` leaves alone,
    and libraries call it: mcp's MCPServer, which a verifiers tool environment builds on its own
    thread, would otherwise set the whole process to INFO (a line for every request httpx sends)."""
    if not logging.root.handlers:
        logging.root.addHandler(logging.lastResort)


def main(argv: list[str] | None = None) -> int:
    keep_logging_as_it_is()
    argv = join_dotted_values(list(sys.argv[1:] if argv is None else argv))
    debug = "--debug" in argv
    try:
        rest, files = split_config_files(argv)
        parser = build_parser()
        args, unknown = parser.parse_known_args(rest)
        overrides = [(k[4:], v) for k, v in vars(args).items() if k.startswith("cfg:")]
        # A dotted flag that is no config field still goes to the config loader, whose error
        # names the key; anything else is argparse's to reject.
        overrides += unknown_dotted_flags(unknown, parser)
        config = load_config(files, overrides)
        for key in sorted({key for key, _ in overrides} & SECRET_FLAGS.keys()):
            print(f"fleetrl: warning: --{key} on the command line is readable by every local user (ps, "
                  f"/proc/PID/cmdline); export {SECRET_FLAGS[key]} instead", file=sys.stderr)
        if args.dry_run:
            check_command(args, config)
            print(to_toml(config), end="")
            return 0
        return run_command(args, config)
    except FleetrlError as e:
        if debug:
            raise
        print(f"fleetrl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fleetrl: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an unexpected failure: still one line unless --debug
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"fleetrl: error: unexpected {type(e).__name__}: {first} (--debug shows the traceback)",
              file=sys.stderr)
        return 1
