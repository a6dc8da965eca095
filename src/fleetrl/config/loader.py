"""The whole config: `Config`, its sections and the checks across them, assembled from (in
increasing precedence) the defaults, TOML files named with `@ file.toml` (merged left to right)
and dotted flags such as `--inference.workers 2`; a subsection is `[inference.dynamo]` in TOML
and `--inference.dynamo.worker` as a flag, and error messages, `--help` and docs/config.md name
a field so too. Every section forbids unknown keys and every error is one line naming the key
and where it came from (a file or the command line), so a misspelt key never silently falls back
to a default. Also the resolved config written back as TOML, secrets left out."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from functools import reduce
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import tomli_w
from pydantic import Field, ValidationError, model_validator

from fleetrl.config.eval import EvalConfig
from fleetrl.config.inference import InferenceConfig, pause_modes
from fleetrl.config.model import ModelConfig
from fleetrl.config.orchestrator import OrchestratorConfig
from fleetrl.config.run import RunConfig
from fleetrl.config.section import Section
from fleetrl.config.sft import SftConfig
from fleetrl.config.trainer import TrainerConfig
from fleetrl.errors import FleetrlError


class ConfigError(FleetrlError):
    """A configuration problem, phrased as one line naming the key and its source."""


# Keys an older fleetrl had elsewhere, each with its place now. A run directory's config.toml
# that an older fleetrl wrote is read with them moved (`load_config`'s `saved`), so such a run
# still verifies and resumes; a config of the user's that names one is refused, naming the new place.
MOVED_KEYS = {f"trainer.{name}": f"trainer.loss.{name}" for name in (  # December 2026: [trainer.loss]
    "clip_low", "clip_high", "tis_cap", "ratio_level", "tis_level", "mis_low", "mis_high", "mis_level", "kl_coef")}


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _completions_fit_the_engine(self) -> "Config":
        # Here only what needs no tokenizer: with the prompts too, `fleetrl rl` checks
        # max_tokens + the longest prompt before it starts anything (app.rl.check_prompts_fit).
        if self.orchestrator.max_tokens >= self.inference.vllm.max_model_len:
            raise ValueError(f"orchestrator.max_tokens = {self.orchestrator.max_tokens} leaves no room for a "
                             f"prompt in inference.vllm.max_model_len = {self.inference.vllm.max_model_len}")
        return self

    @model_validator(mode="after")
    def _pause_mode_fits_an_adapter(self) -> "Config":
        inference = self.inference
        refuses_keep = inference.capabilities().adapter_refuses_keep
        if not (self.trainer.lora.enabled and refuses_keep):
            return self
        modes = pause_modes(inference.token_versions(), inference.dynamo.prefill_workers > 0, adapter_refuses_keep=True)
        if inference.pause_mode is None:
            inference.pause_mode = modes[0]
        elif inference.pause_mode not in modes:
            raise ValueError(f"inference.pause_mode {inference.pause_mode!r} with trainer.lora {refuses_keep}; set "
                             "inference.pause_mode = 'abort' or 'wait'")
        return self

    @model_validator(mode="after")
    def _lr_decays_over_some_steps(self) -> "Config":
        t = self.trainer
        if t.lr_warmup_steps > self.run.max_steps and not t.lr_decay_steps:
            raise ValueError(f"trainer.lr_warmup_steps = {t.lr_warmup_steps} is longer than run.max_steps = "
                             f"{self.run.max_steps}: the rate would never reach trainer.lr")
        if t.lr_decay != "constant" and not t.lr_decay_steps and t.lr_warmup_steps >= self.run.max_steps:
            raise ValueError(f"trainer.lr_decay = {t.lr_decay} has no step to decay over: trainer.lr_warmup_steps = "
                             f"{t.lr_warmup_steps} takes all of run.max_steps = {self.run.max_steps} (or set "
                             "trainer.lr_decay_steps)")
        return self


def field_docs() -> list[tuple[str, str, Any]]:
    """(dotted name, description, default) of every leaf field, for --help and docs.

    The dotted name is also the field's flag and its TOML place: `inference.dynamo.worker` is
    `--inference.dynamo.worker`, or `worker` in the `[inference.dynamo]` table.
    """
    return _leaf_docs(Config, "")


def _leaf_docs(model: type[Section], prefix: str) -> list[tuple[str, str, Any]]:
    rows = []
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            rows += _leaf_docs(field.annotation, f"{prefix}{name}.")
        else:
            default = field.default_factory() if field.default_factory else field.default
            rows.append((f"{prefix}{name}", field.description or "", default))
    return rows


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Section)


def parse_override(text: str, path: tuple[str, ...] = ()) -> Any:
    """A CLI value as TOML (numbers, booleans, lists, quoted strings), else as a bare string.

    A field that only holds text (a token, a name, a path) takes the text as it is: a token
    of digits, such as `--inference.admin_token 0123`, stays the string "0123".
    """
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if not isinstance(value, str) and _holds_only_text(path):
        return text
    return value


def _holds_only_text(path: tuple[str, ...]) -> bool:
    model: Any = Config
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return False
        model = field.annotation
    kinds = [a for a in (get_args(model) if get_origin(model) in (Union, UnionType) else (model,))
             if a is not type(None)]
    return bool(kinds) and all(k in (str, Path) or get_origin(k) is Literal and all(
        isinstance(v, str) for v in get_args(k)) for k in kinds)


def load_config(files: list[Path], overrides: list[tuple[str, str]], saved: Sequence[Path] = ()) -> Config:
    """Merge TOML files and dotted overrides onto the defaults and validate the result. `saved`:
    run directories' config.toml files, merged first (under `files`), their keys that an older
    fleetrl wrote elsewhere read in their places now (MOVED_KEYS)."""
    merged: dict[str, Any] = {}
    source: dict[tuple[str, ...], str] = {}  # key path -> where it was set, for error messages

    for file in [*saved, *files]:
        try:
            data = tomllib.loads(Path(file).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {file}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{file}: invalid TOML: {e}") from None
        if file in saved:
            _move_old_keys(data)
        _merge(merged, data, (), source, str(file))

    for dotted, value in overrides:
        path = tuple(dotted.split("."))
        nested: Any = parse_override(value, path)
        for part in reversed(path):
            nested = {part: nested}
        _merge(merged, nested, (), source, f"--{dotted}")

    try:
        return Config.model_validate(merged)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        origin = _origin(loc, source)
        key = ".".join(loc)
        if err["type"] == "extra_forbidden" and key in MOVED_KEYS:
            raise ConfigError(f"{key} is now {MOVED_KEYS[key]} (from {origin})") from None
        if err["type"] == "extra_forbidden":
            raise ConfigError(f"unknown config key '{key}' (from {origin})") from None
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error" and not _is_leaf(loc):
            # A rule across fields (a section's or the whole config's): its message names them,
            # and any file or flag that set one of them may be at fault.
            raise ConfigError(f"{message} (from {_origins_of_named(loc, source, message)})" if loc else message) \
                from None
        raise ConfigError(f"config key '{key}': {message} (from {origin})") from None


def _move_old_keys(data: dict[str, Any]) -> None:
    """A saved config's keys of MOVED_KEYS, moved in place to where they are now."""
    for old, new in MOVED_KEYS.items():
        *old_tables, old_key = old.split(".")
        table = reduce(lambda at, part: at.get(part) if isinstance(at, dict) else None, old_tables, data)
        if isinstance(table, dict) and old_key in table:
            *new_tables, new_key = new.split(".")
            reduce(lambda at, part: at.setdefault(part, {}), new_tables, data)[new_key] = table.pop(old_key)


def _is_leaf(loc: tuple[str, ...]) -> bool:
    """Whether `loc` names one field (not a section, nor the whole config)."""
    model: Any = Config
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return True  # inside a dict or list value: a field's content
        model = field.annotation
    return bool(loc) and not _is_section(model)


def _merge(into: dict, data: dict, prefix: tuple[str, ...], source: dict, origin: str) -> None:
    for key, value in data.items():
        path = prefix + (key,)
        if isinstance(value, dict):  # key by key, so that each one's origin is known
            if not isinstance(into.get(key), dict):
                into[key] = {}
            _merge(into[key], value, path, source, origin)
        else:
            into[key] = value
        source[path] = origin


def _origin(loc: tuple[str, ...], source: dict) -> str:
    # The longest prefix of the failing location that some file or flag set.
    for n in range(len(loc), 0, -1):
        if loc[:n] in source:
            return source[loc[:n]]
    return "defaults"


def _origins_of_named(loc: tuple[str, ...], source: dict, message: str) -> str:
    """The files and flags that set a key of the section `loc` which `message` names, in the
    order they were read; every one that set a key of it where the message names none."""
    inside = [(path, origin) for path, origin in source.items() if len(path) > len(loc) and path[:len(loc)] == loc]
    named = [origin for path, origin in inside if re.search(rf"\b{re.escape('.'.join(path))}\b", message)]
    return ", ".join(dict.fromkeys(named or [origin for _, origin in inside])) or _origin(loc, source)


def to_toml(config: Config) -> str:
    """The resolved config as TOML, loadable again with `@ file`: one table per section.
    Secrets (tokens) are left out: this text goes to config.toml and to --dry-run's output.
    Written by tomli_w, which quotes what a hand-made writer got wrong (a newline in a string
    was written raw, and config.toml could not be read back: no resume, no verify). The text
    is read back before it is returned, so a config that TOML would not give back as it is
    fails here, before a run starts, not when it resumes."""
    text = tomli_w.dumps({name: _table(getattr(config, name)) for name in Config.model_fields})
    read_back = Config.model_validate(tomllib.loads(text))
    expected = without_secrets(config)
    if read_back != expected:
        key = next(f"{name}.{field}" for name in Config.model_fields
                   for field, value in getattr(expected, name).model_dump().items()
                   if getattr(getattr(read_back, name), field) != getattr(getattr(expected, name), field))
        raise ConfigError(f"config key '{key}': its value does not read back from TOML as it was set")
    return text


def without_secrets(config: Config) -> Config:
    """`config` as config.toml holds it: every secret field unset."""
    updates = {}
    for name in Config.model_fields:
        section = getattr(config, name)
        updates[name] = section.model_copy(update=dict.fromkeys(secret_fields(type(section))))
    return config.model_copy(update=updates)


def secret_fields(section: type[Section]) -> set[str]:
    """A section's fields that hold secrets (tokens): never written to disk or printed."""
    return {name for name, field in section.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("secret")}


def _table(section: Section) -> dict[str, Any]:
    """A section's values as TOML takes them: TOML has no null, so an unset value is left out."""
    values = section.model_dump(mode="json", exclude=secret_fields(type(section)))
    table = {key: value for key, value in values.items() if value is not None}
    for key, field in type(section).model_fields.items():
        if _is_section(field.annotation):
            table[key] = _table(getattr(section, key))
    return table
