"""Inference providers by name (`inference.provider`), and the fleet coordinator on one.

Each entry says how to build the provider and what a config needs to attach to a fleet that
is already running (`fleetrl status` only queries; it never launches one).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetrl.config import Config, InferenceConfig
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.provider import InferenceProvider
from fleetrl.inference.vllm.provider import VllmProvider
from fleetrl.model import resolve_model
from fleetrl.rundir import RunDir


@dataclass(frozen=True)
class ProviderEntry:
    # (config, run directory, model folder — None when only attaching —, admin token) -> provider
    build: Callable[[Config, RunDir, Path | None, str | None], InferenceProvider]
    # What the config lacks to attach to a running fleet, as "fleetrl status needs ..." ends; None: nothing.
    missing_to_attach: Callable[[InferenceConfig], str | None]


def _vllm(config: Config, run_dir: RunDir, model_dir: Path | None, token: str | None) -> VllmProvider:
    return VllmProvider(config.inference, model_dir, run_dir.logs_dir, token)


def _vllm_missing(inference: InferenceConfig) -> str | None:
    if not inference.urls:
        return "inference.urls (the workers to query) and inference.admin_token"
    if not inference.admin_token:
        return "inference.admin_token (printed in the run's logs)"
    return None


def _dynamo(config: Config, run_dir: RunDir, model_dir: Path | None, token: str | None) -> DynamoProvider:
    # No token: Dynamo's admin routes are the workers' own system ports, which take none.
    return DynamoProvider(config.inference, model_dir, run_dir.root)


def _dynamo_missing(inference: InferenceConfig) -> str | None:
    if not inference.dynamo.frontend_url:
        return "inference.dynamo.frontend_url and inference.dynamo.rl_url (the deployment to query)"
    return None


PROVIDERS: dict[str, ProviderEntry] = {
    "vllm": ProviderEntry(build=_vllm, missing_to_attach=_vllm_missing),
    "dynamo": ProviderEntry(build=_dynamo, missing_to_attach=_dynamo_missing),
}


def build_provider(config: Config, model_dir: Path | None, token: str | None) -> InferenceProvider:
    return PROVIDERS[config.inference.provider].build(config, RunDir(config.run.dir), model_dir, token)


def build_fleet(config: Config) -> tuple[Fleet, Path]:
    """The fleet coordinator on the configured provider, and the model folder it serves. The
    admin token is `inference.admin_token`, or a fresh random one for this run."""
    model_dir = resolve_model(config.model)
    token = config.inference.admin_token or secrets.token_urlsafe(24)
    fleet = Fleet(build_provider(config, model_dir, token), pause_mode=config.inference.resolved_pause_mode(),
                  discovery_interval_s=config.inference.discovery_interval_s)
    return fleet, model_dir
