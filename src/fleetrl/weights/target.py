"""What a transport's updates replace on a worker, named in its init record (both transports'):

    "model"    the model's weights, loaded through vLLM's layerwise reload (full fine-tuning)
    "adapter"  the worker's LoRA adapter only (fleetrl/lora.py): the base weights stay

A transport sends one kind for its life: a LoRA run publishes only its adapter.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from fleetrl.strict import Strict

UpdateTarget = Literal["model", "adapter"]


class GrouplessInit(Strict):
    """The init record of a transport with no group to join (each version is written where the
    workers read it): the target alone. A transport's subclass names it in `transport`."""

    transport: ClassVar[str]

    target: UpdateTarget = "model"

    def to_dict(self) -> dict[str, Any]:
        return {"transport": self.transport, **super().to_dict()}


class GrouplessReceiver:
    """The receiver side of such a transport: nothing to join, reset or release, since each
    update names a whole version every rank reads on its own. A subclass writes `receive`."""

    @classmethod
    def join(cls, init: GrouplessInit, worker_rank: int) -> GrouplessReceiver:
        return cls()

    @property
    def state(self) -> str:
        return ""

    def reset_on_failure(self) -> None:
        """Nothing to reset: the next update reads its own version."""

    def close(self) -> None:
        """Nothing to release: each update reads its own version."""
