"""Trainer ranks 1..N-1: `python -m fleetrl.trainer RUN_DIR MODEL_DIR`, started by `fleetrl rl`
with torchrun-style environment variables. Rank 0 runs in the `fleetrl rl` process itself."""

import sys
from pathlib import Path

from fleetrl.config import load_config
from fleetrl.rundir import RunDir
from fleetrl.trainer import distributed
from fleetrl.trainer.loop import Hooks, train


def main() -> None:
    run_dir, model_dir = RunDir(Path(sys.argv[1])), Path(sys.argv[2])
    config = load_config([run_dir.config_path], [])
    world = distributed.init(timeout_s=distributed.collective_timeout_s(config))
    distributed.use_cpus(config.trainer.cpu_cores, world.rank, world.world_size)

    try:
        # Waits for each batch without a deadline: rank 0 watches the orchestrator and ends
        # this process if the run fails.
        train(config, run_dir, model_dir, world, Hooks(wait_batch=run_dir.wait_batch), log=lambda *_: None)
    finally:
        distributed.destroy()


if __name__ == "__main__":
    main()
