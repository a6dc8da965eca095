"""Trainer ranks 1..N-1 that `fleetrl rl` and `fleetrl sft` start themselves: `python -m
fleetrl.trainer MODE RUN_DIR MODEL_DIR` (MODE rl or sft), with torchrun-style environment
variables. Rank 0 runs in the `fleetrl` process itself. (Under torchrun every rank is a
`fleetrl rl` or `fleetrl sft` process: app/rl.py's `run_peer_rank`, app/sft.py's.) Like
`fleetrl` itself, a rank runs with the tripwire of process-wide state armed when FLEETRL_TRIPWIRE=1
(fleetrl/tripwire.py), which it inherits from the run."""

import sys
from pathlib import Path

from fleetrl import tripwire
from fleetrl.heavy_imports import imports_without_gc

with imports_without_gc():
    from fleetrl.rundir import KINDS, RunDir
    from fleetrl.trainer import distributed
    from fleetrl.trainer.loop import train_peer
    from fleetrl.trainer.sft import train_sft_peer


def main(argv: list[str]) -> int:
    """The rank's exit status: `argv` is MODE RUN_DIR MODEL_DIR."""
    mode, run_dir, model_dir = argv
    if mode not in KINDS:
        raise SystemExit(f"fleetrl.trainer: mode {mode!r} is not one of {', '.join(KINDS)}")
    return tripwire.run_armed(lambda: train_rank(mode, Path(run_dir), Path(model_dir)))


def train_rank(mode: str, root: Path, model_dir: Path) -> int:
    run_dir = RunDir(root, kind=mode)
    config = run_dir.read_config()
    world = distributed.init(timeout_s=distributed.collective_timeout_s(config))
    try:
        (train_sft_peer if mode == "sft" else train_peer)(config, run_dir, model_dir, world)
    finally:
        distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
