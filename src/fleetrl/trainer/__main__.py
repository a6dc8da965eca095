"""Trainer ranks 1..N-1 that `fleetrl rl` starts itself: `python -m fleetrl.trainer RUN_DIR
MODEL_DIR`, with torchrun-style environment variables. Rank 0 runs in the `fleetrl rl` process
itself. (Under torchrun every rank is a `fleetrl rl` process: app/rl.py's `run_peer_rank`.)"""

import sys
from pathlib import Path

from fleetrl.config import load_config
from fleetrl.rundir import RunDir
from fleetrl.trainer import distributed
from fleetrl.trainer.loop import train_peer


def main() -> None:
    run_dir, model_dir = RunDir(Path(sys.argv[1])), Path(sys.argv[2])
    config = load_config([run_dir.config_path], [])
    world = distributed.init(timeout_s=distributed.collective_timeout_s(config))
    try:
        train_peer(config, run_dir, model_dir, world)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
