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

from fleetrl import tripwire
from fleetrl.app.bench import SUITE_CHOICES, SUITES
from fleetrl.app.commands import base_config_files, check_command, run_command
from fleetrl.config import ConfigError, field_docs, load_config, to_toml
from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV
from fleetrl.errors import FleetrlError

COMMANDS = {
    "rl": "Run an RL job: fleet, trainer ranks and orchestrator.",
    "sft": "Supervised warm start: train the policy on a dataset of conversations or prompt/completion pairs "
           "([sft]; the loss on the assistant's tokens) with the RL trainer's ranks, LoRA and checkpoints; "
           "RUN_DIR/final_model is a model.path for `fleetrl rl`. No inference worker is started.",
    "inference": "Start the inference fleet, sample a few completions, print them and shut down.",
    "status": "Show each worker of a fleet (a running run's, or the one the config names): role, state, "
              "policy version, weight checksum, requests in flight, last publish; for a finished run, how it left them.",
    "verify": "Re-check a finished run directory's manifest and invariants.",
    "plot": "Draw a run's plots (reward.png, off_policy.png, the version timeline timeline.png, and eval.png "
            "when it evaluates) from its metrics, events and evaluations, while it runs or after.",
    "export": "Write a run's checkpoint (the newest complete one, or --step N) as a Hugging Face folder (a LoRA "
              "run's adapter merged in), or with --adapter a LoRA run's adapter as a peft adapter folder.",
    "eval": "Score a saved model — a Hugging Face folder, or a run's final model or checkpoint — on the run's "
            "evaluation environments ([eval]) with the config's workers; print the table, write the records.",
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


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as fleetrl's: one line naming the command and the argument at fault
    (argparse prints a usage line first, the top-level one for an unknown argument)."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fleetrl",
        description="Asynchronous RL against a fleet of inference workers, with per-token policy versions.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub = commands.add_parser(
            name, help=help_text, description=help_text, allow_abbrev=False,
            usage=f"fleetrl {name}{' [RUN_DIR]' if name in RUN_DIR_COMMANDS else ''}"
                  f"{' OUT_DIR' if name == 'export' else ''}{' [MODEL_OR_RUN]' if name == 'eval' else ''} "
                  "[@ CONFIG.toml ...] "
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
            sub.add_argument("--adapter", action="store_true",
                             help="A LoRA run's adapter alone, as a peft adapter folder (adapter_config.json, "
                                  "adapter_model.safetensors) [default: the whole model, the adapter merged in].")
        if name == "eval":
            sub.add_argument("model_or_run", nargs="?", type=Path, metavar="MODEL_OR_RUN",
                             help="A Hugging Face model folder (scored as version 0), or a run directory: its "
                                  "config.toml is the config this command starts from, and its final_model/ (else "
                                  "its newest complete checkpoint) is scored at its version [default: the config's "
                                  "own model, model.path else the embedded default; --out is then needed].")
            sub.add_argument("--step", type=int, metavar="N",
                             help="Score the run's checkpoint of step N, exported into a temporary folder "
                                  "[default: RUN_DIR/final_model, else the newest complete checkpoint].")
            sub.add_argument("--out", type=Path, metavar="DIR",
                             help="The new folder for the records (eval.jsonl, eval/step_N.jsonl) and the "
                                  "launched workers' logs: the command's run.dir [default: beside the run or model "
                                  "folder, never inside a run: RUN_DIR-eval-vN, FOLDER-eval].")
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


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def command_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag of every command that is no config field (--dry-run, --step, --help...)."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for sub in [parser, *subparsers.choices.values()] for action in sub._actions
            for flag in action.option_strings if not flag.startswith("--") or "." not in flag}


def join_dotted_values(argv: list[str], flags: set[str]) -> list[str]:
    """`--section.key VALUE` -> `--section.key=VALUE`, whatever VALUE begins with.

    argparse reads an argument that starts with "-" as an option, so a token such as `-x3f`
    or a value `-1` would be refused as a missing value; joined, it is the flag's value. A
    flag followed by another flag (`--run.dir --dry-run`; `flags`: the commands' own) has no
    value: refused, naming it, rather than taking that flag as its value (and running without
    --dry-run).
    """
    out = []
    it = iter(argv)
    for arg in it:
        if is_dotted_flag(arg) and "=" not in arg:
            value = next(it, None)
            if value is None or is_dotted_flag(value) or value in flags:
                raise ConfigError(f"{arg} needs a value ({arg} VALUE or {arg}=VALUE)"
                                  + (f", not the flag {value}" if value else ""))
            arg = f"{arg}={value}"
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
    """The command, with the tripwire of process-wide state armed from here, the main thread,
    before any thread starts, when FLEETRL_TRIPWIRE=1 (fleetrl/tripwire.py): a setter called off
    the main thread ends the command with status 1 and a line naming it and the thread."""
    return tripwire.run_armed(lambda: run_command_line(argv))


def run_command_line(argv: list[str] | None) -> int:
    keep_logging_as_it_is()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        parser = build_parser()
        rest, files = split_config_files(join_dotted_values(argv, command_flags(parser)))
        args, unknown = parser.parse_known_args(rest)
        overrides = [(k[4:], v) for k, v in vars(args).items() if k.startswith("cfg:")]
        # A dotted flag that is no config field still goes to the config loader, whose error
        # names the key; anything else is argparse's to reject.
        overrides += unknown_dotted_flags(unknown, command_parser(parser, args.command))
        config = load_config(files, overrides, saved=base_config_files(args))
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
