"""`[trainer.loss]`: the policy loss's options and the rule for which of them combine, read as
they are by the loss itself (`fleetrl.trainer.loss.policy_loss`), so each is declared and
checked here only."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from fleetrl.config.section import Section, no_nan


class LossConfig(Section):
    """The policy loss: the PPO clip and the TIS cap on the importance ratio pi/mu by default, and a
    menu of other treatments of it (sequence-level TIS, masked importance sampling, GSPO's sequence
    ratio, a KL penalty). Each turns off at a value, not at None: TOML has no null, but has inf.
    The math: docs/design/trainer.md, "The loss"."""

    clip_low: float = Field(
        0.2, ge=0, le=1, description="PPO clip floor of the trainer/inference ratio, 1 - clip_low; 1 = off."
    )
    clip_high: float = Field(0.28, ge=0, allow_inf_nan=True,
                             description="PPO clip ceiling of the ratio, 1 + clip_high; inf = off.")
    tis_cap: float = Field(
        2.0, gt=0, allow_inf_nan=True,
        description="Truncated importance sampling: the most weight a token's ratio may carry; inf = off.",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="The ratio the PPO clip and the TIS cap act on: token = each token's own pi/mu; sequence = "
        "GSPO, the sample's exp(mean log pi/mu) on each of its tokens, so a sample is clipped or kept whole. Pick "
        "sequence for MoE models (routing noise in the token ratios averages out) or long sequences, with a far "
        "narrower clip (GSPO's: clip_low = 3e-4, clip_high = 4e-4).",
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token",
        description="What tis_cap caps: token = each token's ratio; sequence = the sample's product of ratios, "
        "the whole sequence's importance weight, which then weighs each of its tokens (needs a finite tis_cap; not "
        "with ratio_level = sequence). Pick sequence for long multi-turn samples, where the mismatch compounds "
        "from turn to turn; the product varies more the longer the sample, so the cap does more.",
    )
    # The band must hold 1, the tokens where trainer and sampler agree.
    mis_low: float = Field(
        0.0, ge=0, lt=1,
        description="Masked importance sampling (MIS): the floor of the band of the ratio pi/mu outside which "
        "mis_level drops tokens (they give no loss and no gradient, but still count in the divisor); in [0, 1), "
        "0 = off. metrics: masked_frac.",
    )
    mis_high: float = Field(
        math.inf, gt=1, allow_inf_nan=True,
        description="The ceiling of the MIS band, above 1; inf = off. IcePop is token-level MIS with the band [0.5, 5] "
        "and neither clip nor cap: configs/icepop.toml.",
    )
    mis_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="What the MIS band drops: token = each token outside it; sequence = a whole sample with any "
        "token outside; geometric = a whole sample whose geometric-mean ratio exp(mean log pi/mu) is outside. "
        "Pick masking over the TIS cap when a few tokens are far off (MoE routing, a kernel bug), which a cap "
        "keeps at its weight: token for short samples, sequence for long multi-turn ones (one broken token "
        "spoils what follows it), geometric when lengths vary (any-token rejects long samples more often).",
    )
    kl_coef: float = Field(
        0.0, ge=0,
        description="Weight of a KL penalty to the base model (the policy as the run started, kept through "
        "resumes), per token the k3 estimate of KL(pi, base); 0 = off. Pick it when drift from the base must be "
        "bounded (a reward that can be gamed, abilities to keep). Costs one more fp32 copy of each rank's share "
        "of the parameters and a forward without gradient per step; metrics: ref_kl.",
    )

    @field_validator("clip_high", "tis_cap", "mis_high")
    @classmethod
    def _inf_is_off_but_nan_is_nothing(cls, value: float) -> float:
        return no_nan(value)

    @model_validator(mode="after")
    def _options_combine(self) -> "LossConfig":
        if self.tis_level == "sequence" and self.ratio_level == "sequence":
            raise ValueError("trainer.loss.tis_level = 'sequence' does not combine with trainer.loss.ratio_level = "
                             "'sequence': GSPO's ratio is already the sample's importance weight (length-normalized); "
                             "cap it with trainer.loss.tis_level = 'token'")
        if self.tis_level == "sequence" and math.isinf(self.tis_cap):
            raise ValueError("trainer.loss.tis_level = 'sequence' needs a finite trainer.loss.tis_cap: a sample's "
                             "uncapped product of ratios overflows")
        return self
