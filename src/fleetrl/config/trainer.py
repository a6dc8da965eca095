"""`[trainer]`: the trainer's ranks, optimizer and learning-rate schedule, checkpoints, and the
`[trainer.lora]` adapter; its `[trainer.loss]` section is a module of its own (`loss.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fleetrl.config.loss import LossConfig
from fleetrl.config.section import Section, check_cpu_lists
from fleetrl.lora import LLAMA_LINEARS, VLLM_MAX_LORA_RANKS, AdapterSpec, vllm_max_lora_rank


class LoraConfig(Section):
    """LoRA: train low-rank adapters on the base model's linear layers instead of all its weights
    (peft); only the adapter is trained, checkpointed and published. Off while rank = 0. Served by
    the workers fleetrl launches (native vLLM, or Dynamo without prefill workers); refused with
    inference.urls, inference.dynamo.frontend_url and inference.dynamo.prefill_workers > 0."""

    rank: int = Field(
        0, ge=0,
        description=f"The adapter's rank r; 0 = off (full fine-tuning). At most {VLLM_MAX_LORA_RANKS[-1]}: workers "
        "serve it with the smallest vLLM --max-lora-rank at least r "
        f"(one of {', '.join(map(str, VLLM_MAX_LORA_RANKS))}).",
    )
    alpha: float = Field(16.0, gt=0, description="LoRA's alpha: the update B A is scaled by alpha / rank (alpha / "
                         "sqrt(rank) with use_rslora).")
    dropout: float = Field(
        0.0, ge=0, lt=1,
        description="Dropout on the adapter's input while training. Keep 0: the importance ratio compares the "
        "trainer's logprob of each token with the sampler's, and a forward with dropout scores the same token at "
        "random, which the ratio, the clip and the mismatch figures would take for a policy change.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LLAMA_LINEARS),
        description="The linear layers that get an adapter, by name within a decoder layer. Not embed_tokens nor "
        "lm_head: SmolLM2 ties them, and workers refit the tied head from the embedding.",
    )
    use_rslora: bool = Field(False, description="Rank-stabilized LoRA: scale by alpha / sqrt(rank) instead of "
                             "alpha / rank, so a larger rank does not shrink the update.")

    @field_validator("rank")
    @classmethod
    def _vllm_serves_the_rank(cls, value: int) -> int:
        if value:
            vllm_max_lora_rank(value)  # its ValueError says why
        return value

    @field_validator("target_modules")
    @classmethod
    def _linears_only(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("names no layer: list the linear layers that get an adapter")
        tied = [name for name in value if name in ("embed_tokens", "lm_head")]
        if tied:
            raise ValueError(f"{tied[0]} cannot take an adapter: the embedding and the head are tied (one tensor), "
                             "and workers refit the head from the embedding; adapt the linear layers only")
        unknown = [name for name in value if name not in LLAMA_LINEARS]
        if unknown:  # peft would adapt the names it finds and drop the rest without a word
            raise ValueError(f"{unknown[0]} is no linear layer of a decoder layer: name some of "
                             f"{', '.join(LLAMA_LINEARS)}")
        if len(set(value)) != len(value):
            raise ValueError("names a layer twice")
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def spec(self) -> AdapterSpec | None:
        """The adapter these settings make; None while LoRA is off."""
        if not self.enabled:
            return None
        return AdapterSpec(rank=self.rank, alpha=self.alpha, target_modules=tuple(self.target_modules),
                           use_rslora=self.use_rslora, dropout=self.dropout)


class TrainerConfig(Section):
    """The trainer's ranks, optimizer and checkpoints; the policy loss is `[trainer.loss]`, LoRA `[trainer.lora]`."""

    world_size: int = Field(1, ge=1, description="Number of trainer ranks (torch.distributed) that `fleetrl rl` "
                            "starts on this machine. Under torchrun, WORLD_SIZE: leave it unset (docs/cluster.md).")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate: the peak of the schedule (lr_warmup_steps, "
                      "lr_decay); the rate of each step is in metrics.jsonl (`update.lr`).")
    lr_warmup_steps: int = Field(
        0, ge=0, description="Steps 1..N climb linearly to `lr`: the first batches' advantages are the noisiest and "
        "Adam's moments are not settled yet. 0 = none.")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After warmup: constant keeps `lr`; linear and cosine decay it from `lr` toward "
        "`lr_min` over `lr_decay_steps` (each step at the rate as it begins: the last still learns), then hold "
        "`lr_min`. Cosine stays near the peak longer and eases into the end.")
    lr_decay_steps: int = Field(
        0, ge=0, description="Steps the decay runs over after warmup; 0 = until run.max_steps (a resume that raises "
        "max_steps then stretches the rest of the decay: set this to keep it fixed).")
    lr_min: float = Field(0.0, ge=0, description="Where linear or cosine decay ends; at most `lr`.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(
        1.0, gt=0, description="The global gradient norm is clipped to this before each optimizer step."
    )
    micro_batch_tokens: int = Field(
        4096, ge=1,
        description="Rows x padded length of one forward/backward, a row holding a group's prompt once and its "
        "completions: bounds activation memory.",
    )
    checkpoint_interval: int = Field(
        10, ge=0,
        description="Save a checkpoint every N steps and at the last step (0 = never: the run can then be neither "
        "resumed nor extended).",
    )
    cpu_cores: list[str] = Field(
        default_factory=list,
        description="Per trainer rank (cycled), the CPUs it runs on, as a CPU list (\"1\", \"2-3\"), with one torch "
        "thread per CPU. Empty: every CPU, the threads shared out among the ranks. Filled by run.core_plan = \"auto\".",
    )

    @field_validator("cpu_cores")
    @classmethod
    def _cpu_lists(cls, value: list[str]) -> list[str]:
        return check_cpu_lists(value)

    @model_validator(mode="after")
    def _lr_min_below_the_peak(self) -> "TrainerConfig":
        if self.lr_min > self.lr:
            raise ValueError(f"trainer.lr_min ({self.lr_min:g}) must be at most trainer.lr ({self.lr:g})")
        return self

    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept; older ones are deleted.")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="A step whose loss or gradient norm is not finite is never applied: stop = the "
        "run ends with an error naming the step; skip = the step's update is skipped and counted "
        "(metrics: skipped), the version is still published.",
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
