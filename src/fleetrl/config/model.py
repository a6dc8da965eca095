"""`[model]`: the policy's Hugging Face folder, or the embedded model and where it is materialized."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from fleetrl.config.section import Section


class ModelConfig(Section):
    path: Path | None = Field(
        None,
        description="Local Hugging Face model folder; unset = the embedded SmolLM2-135M-Instruct "
        "(materialized once into the fleetrl cache).",
    )
    cache_dir: Path | None = Field(
        None,
        description="Where the embedded model is materialized; unset = $FLEETRL_CACHE, else "
        "~/.cache/fleetrl.",
    )
