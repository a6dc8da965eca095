"""Trainer ranks 1..N-1 that `fleetrl rl` starts itself: `python -m fleetrl.trainer RUN_DIR
MODEL_DIR`, with torchrun-style environment variables. Rank 0 runs in the `fleetrl rl` process
itself. (Under torchrun every rank is a `fleetrl rl` process: app/rl.py's `run_peer_rank`.) Like
`fleetrl` itself, a rank runs with the tripwire of process-wide state armed when FLEETRL_TRIPWIRE=1
(fleetrl/tripwire.py), which it inherits from the run."""

import sys
from pathlib import Path

from fleetrl import tripwire
from fleetrl.config import load_config
from fleetrl.rundir import RunDir
from fleetrl.trainer import distributed
from fleetrl.trainer.loop import train_peer


def main(argv: list[str]) -> int:
    """The rank's exit status: `argv` is RUN_DIR MODEL_DIR."""
    return tripwire.run_armed(lambda: train_rank(RunDir(Path(argv[0])), Path(argv[1])))


def train_rank(run_dir: RunDir, model_dir: Path) -> int:
    config = load_config([run_dir.config_path], [])
    world = distributed.init(timeout_s=distributed.collective_timeout_s(config))
    try:
        train_peer(config, run_dir, model_dir, world)
    finally:
        distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
