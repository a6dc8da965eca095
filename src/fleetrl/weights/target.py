"""What a transport's updates replace on a worker, named in its init record (both transports'):

    "model"    the model's weights, loaded through vLLM's layerwise reload (full fine-tuning)
    "adapter"  the worker's LoRA adapter only (fleetrl/lora.py): the base weights stay

A transport sends one kind for its life: a LoRA run publishes only its adapter.
"""

from __future__ import annotations

from typing import Literal, get_args

UpdateTarget = Literal["model", "adapter"]
TARGETS = get_args(UpdateTarget)


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"init_info.target: {target!r} is not one of {TARGETS}")
