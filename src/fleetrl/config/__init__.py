"""Configuration: one pydantic model per section, loaded from TOML files and dotted CLI flags.
Each section's schema is a module of its own, on the base in `section.py`: `model`, `inference`
with its `vllm`, `dynamo` and `weights` subsections, `orchestrator`, `trainer` with its `loss` and
`lora` subsections, `eval`, `sft` and `run`; `loader.py` assembles them into `Config`, holds
the checks across sections, reads TOML files and flags, and writes the resolved config back as
TOML. The package's public names are declared here, once: import them from `fleetrl.config`.
"""

from fleetrl.config.dynamo import DynamoConfig
from fleetrl.config.eval import EvalConfig
from fleetrl.config.inference import InferenceConfig, PauseMode, admin_backoff_s, pause_modes
from fleetrl.config.loader import Config, ConfigError, field_docs, load_config, secret_fields, to_toml
from fleetrl.config.loss import LossConfig
from fleetrl.config.model import ModelConfig
from fleetrl.config.orchestrator import EnvEntry, OrchestratorConfig
from fleetrl.config.run import RunConfig
from fleetrl.config.sft import SftConfig
from fleetrl.config.trainer import LoraConfig, TrainerConfig
from fleetrl.config.vllm import LAUNCHER_OWNED_ARGS, VllmConfig
from fleetrl.config.weights import WeightsConfig

__all__ = [
    "LAUNCHER_OWNED_ARGS", "Config", "ConfigError", "DynamoConfig", "EnvEntry", "EvalConfig", "InferenceConfig",
    "LoraConfig", "LossConfig", "ModelConfig", "OrchestratorConfig", "PauseMode", "RunConfig", "SftConfig",
    "TrainerConfig", "VllmConfig", "WeightsConfig", "admin_backoff_s", "field_docs", "load_config", "pause_modes",
    "secret_fields", "to_toml",
]
