"""A LoRA adapter as fleetrl moves it between processes: peft's folder format, which vLLM's LoRA
loader, transformers + peft and `fleetrl export --adapter` all read, and the names its tensors
travel under (without peft's folder prefix, which the folder adds). A leaf, so the trainer, the
engine side and the launchers share it without importing one another. The format, and why a
worker gets a folder rather than tensors in memory: docs/design/trainer.md, "LoRA"."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from fleetrl.errors import FleetrlError
from fleetrl.files import atomic_write

if TYPE_CHECKING:  # torch is imported where tensors are made: the config imports this module
    import torch

# The name requests use to be served through the adapter. It may not be the base model's
# served name (`policy`): vLLM refuses an adapter named like a served model.
ADAPTER_NAME = "policy-lora"
# Set on a vLLM server's processes: the folder its `--lora-modules` entry points at, which the
# engine side keeps current. A server without it cannot take an adapter update.
ADAPTER_DIR_ENV = "FLEETRL_ADAPTER_DIR"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_FOLDER_PREFIX = "base_model.model."
PEFT_ADAPTER = "default"  # peft's name for a model's one adapter, in its parameters' names
# The ranks vLLM's --max-lora-rank accepts (vllm/config/lora.py, MaxLoRARanks): a worker serves an
# adapter of rank r with the smallest of them that is at least r.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The linear layers of a Llama decoder layer, which vLLM can serve a LoRA on. Embeddings and
# the LM head are not offered: SmolLM2 ties them, and workers refit the tied head separately.
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class AdapterError(FleetrlError):
    """Adapter tensors that do not fit the adapter's config."""


def vllm_max_lora_rank(rank: int) -> int:
    """The --max-lora-rank a vLLM worker needs to serve an adapter of `rank`: the smallest value
    vLLM accepts that is at least `rank`."""
    fitting = [allowed for allowed in VLLM_MAX_LORA_RANKS if allowed >= rank]
    if rank < 1 or not fitting:
        raise ValueError(f"a LoRA rank must be 1 to {VLLM_MAX_LORA_RANKS[-1]} (what vLLM serves), got {rank}")
    return fitting[0]


@dataclass(frozen=True)
class AdapterSpec:
    """What shapes an adapter: the config half of its folder."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False
    dropout: float = 0.0

    def peft_config(self, base_model: str | Path) -> dict:
        """adapter_config.json: what peft's LoraConfig and vLLM's PEFTHelper read."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model),
                "r": self.rank, "lora_alpha": self.alpha, "target_modules": list(self.target_modules),
                "lora_dropout": self.dropout, "use_rslora": self.use_rslora, "bias": "none"}

    def engine_args(self) -> list[str]:
        """The vLLM engine arguments of a worker that serves this adapter (native or Dynamo's)."""
        return ["--enable-lora", "--max-lora-rank", str(vllm_max_lora_rank(self.rank)),
                # One adapter, the policy's: a second slot would only cost memory.
                "--max-loras", "1", "--max-cpu-loras", "1",
                # The adapter's layers alone: vLLM otherwise wraps the LM head too, and its CPU LoRA
                # logits path fails on a batch mixing prompt logprobs (the agreement probe, which
                # runs while kept requests go on) with sampled requests.
                "--lora-target-modules", *self.target_modules]

    @classmethod
    def of_folder(cls, folder: Path) -> AdapterSpec:
        return cls.of_peft_config(json.loads((folder / ADAPTER_CONFIG_FILE).read_text()))

    @classmethod
    def of_peft_config(cls, config: dict) -> AdapterSpec:
        return cls(rank=config["r"], alpha=config["lora_alpha"], target_modules=tuple(config["target_modules"]),
                   use_rslora=config.get("use_rslora", False), dropout=config.get("lora_dropout", 0.0))

    def check(self, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
        """Every tensor is one of this adapter's: a target module's lora_A [rank, in] or
        lora_B [out, rank]. Checked before a worker's folder changes: vLLM would find out only
        inside the next forward step, where a failure costs the requests in it."""
        for name, tensor in tensors:
            match = _NAME.fullmatch(name)
            if match is None or match[3] not in self.target_modules:
                raise AdapterError(f"{where}: {name} is no tensor of an adapter on {', '.join(self.target_modules)}")
            rank_dim = 0 if match[4] == "A" else 1
            if tensor.dim() != 2 or tensor.shape[rank_dim] != self.rank:
                raise AdapterError(f"{where}: {name} has shape {tuple(tensor.shape)}, not rank {self.rank}")


def held_names(folder: Path) -> set[str]:
    """The names (without peft's folder prefix) of the tensors the adapter folder holds."""
    with safe_open(str(folder / ADAPTER_WEIGHTS_FILE), "pt") as weights:
        return {key.removeprefix(PEFT_FOLDER_PREFIX) for key in weights.keys()}


def check_complete(folder: Path, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """The tensors are the whole adapter the folder holds now, every one of its names once: an
    update that ended early (an abandoned publish still closes the update) never replaces the
    adapter with a part of one."""
    names = [name for name, _ in tensors]
    held = held_names(folder)
    missing, unknown = sorted(held - set(names)), sorted(set(names) - held)
    if missing or unknown or len(names) != len(held):
        raise AdapterError(f"{where}: {len(names)} tensors received, not the adapter's {len(held)}"
                           + (f" (missing {missing[0]}, ...)" if missing else "")
                           + (f" (unknown {unknown[0]}, ...)" if unknown else ""))


def write_adapter(folder: Path, peft_config: dict, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The adapter folder, each file replaced atomically (the weights last: a reader never
    sees weights without the config that shapes them)."""
    atomic_write(folder / ADAPTER_CONFIG_FILE, json.dumps(peft_config, indent=1) + "\n")
    write_weights(folder, tensors)


def write_weights(folder: Path, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The adapter's tensors into its folder, replacing the file they were in atomically."""
    from safetensors.torch import save

    weights = {PEFT_FOLDER_PREFIX + name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors}
    atomic_write(folder / ADAPTER_WEIGHTS_FILE, save(weights, metadata={"format": "pt"}))


def zero_adapter(model_dir: Path, spec: AdapterSpec) -> dict[str, torch.Tensor]:
    """An adapter that changes nothing (every tensor zero, fp32 like the trainer's), shaped for
    the model in `model_dir`: what a launched worker holds before the first adapter update, so it
    serves the base model's v0 through the adapter's name. Its shapes come from the model's
    config.json, with no model built: the launchers call this on the control loop's thread, and
    transformers' model init sets torch's default dtype for the whole process while it runs."""
    import torch

    layers, linears = decoder_linears(model_dir / "config.json")
    return {f"model.layers.{layer}.{block}.{module}.lora_{half}.weight":
            torch.zeros((spec.rank, fan_in) if half == "A" else (fan_out, spec.rank), dtype=torch.float32)
            for layer in range(layers) for module, (block, fan_in, fan_out) in linears.items()
            if module in spec.target_modules for half in ("A", "B")}


def decoder_linears(config_path: Path) -> tuple[int, dict[str, tuple[str, int, int]]]:
    """The number of decoder layers of the model whose config.json is `config_path`, and each
    linear of LLAMA_LINEARS in a layer, in the layer's order: (its block, in features, out
    features), as transformers' Llama (and Qwen2/3, Mistral) builds them."""
    config = json.loads(config_path.read_text())

    def size(name: str, default: int | None = None) -> int:
        value = config.get(name, default)
        if type(value) is not int or value < 1:
            raise AdapterError(f"{config_path}: {name} is {value!r}, not a positive integer (a LoRA adapter "
                               "takes the shapes of a Llama-style decoder's linear layers)")
        return value

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    q_out = heads * (size("head_dim") if config.get("head_dim") is not None else hidden // heads)
    kv_out = size("num_key_value_heads", heads) * (q_out // heads)
    intermediate = size("intermediate_size")
    return size("num_hidden_layers"), {
        "q_proj": ("self_attn", hidden, q_out), "k_proj": ("self_attn", hidden, kv_out),
        "v_proj": ("self_attn", hidden, kv_out), "o_proj": ("self_attn", q_out, hidden),
        "gate_proj": ("mlp", hidden, intermediate), "up_proj": ("mlp", hidden, intermediate),
        "down_proj": ("mlp", intermediate, hidden)}


def write_zero_adapter(folder: Path, spec: AdapterSpec, model_dir: Path) -> None:
    """A launched worker's folder at every start: an adapter that changes nothing, so a fresh or
    restarted worker serves the base model's v0 through the adapter's name until its refit."""
    write_adapter(folder, spec.peft_config(model_dir), zero_adapter(model_dir, spec).items())


def adapter_key(name: str) -> str | None:
    """The name in peft's saved form of an adapter tensor, given its parameter's name
    (`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`) or that form itself; None
    for a name that is not the adapter's. The one test of which tensors are the adapter."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("lora_A", "lora_B"):
            return ".".join(parts[:i + 1] + parts[i + 2 if parts[i + 1] == PEFT_ADAPTER else i + 1:])
    return None
