"""One trainer rank of the resharding test (test_trainer_ranks), started by a real torchrun:
`python -m tests.integration.reshard_job write|resume OUT_DIR MODEL_DIR`.

write: train on batch 0, checkpoint as step 1, train on batch 1.
resume: load that checkpoint (written by another number of ranks), train on batch 1.
Rank 0 saves the full weights after each part to OUT_DIR/<mode>-<world size>.pt.
"""

import os
import sys
import traceback
from pathlib import Path

import torch

from fleetrl.trainer import checkpoint, distributed
from fleetrl.trainer.model import load_policy
from fleetrl.trainer.step import build_optimizer, train_step
from tests.integration.test_trainer_ranks import CFG, full_weights


def main() -> None:
    mode, out_dir, model_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    batches = torch.load(out_dir / "batches.pt", weights_only=False)
    torch.set_num_threads(1)  # several ranks on a shared two-core machine
    world = distributed.init(timeout_s=120)
    try:
        model = load_policy(model_dir, world.device)
        optimizer = build_optimizer(model, CFG)
        result = {}
        if mode == "write":
            train_step(model, optimizer, batches[0], CFG)
            checkpoint.save(out_dir / "checkpoints", 1, model, optimizer, keep=2)
        else:
            result["loaded_step"] = checkpoint.load(out_dir / "checkpoints", model, optimizer)
        result["updated"] = full_weights(model)
        train_step(model, optimizer, batches[1], CFG)
        result["continued"] = full_weights(model)
        if world.rank == 0:
            torch.save(result, out_dir / f"{mode}-{world.world_size}.pt")
    except BaseException:
        (out_dir / f"{mode}-rank{world.rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        distributed.destroy()
    os._exit(0)  # as tests/ranks.py: no interpreter finalization under gloo


if __name__ == "__main__":
    main()
