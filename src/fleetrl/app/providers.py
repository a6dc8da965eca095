"""Inference providers by name (`inference.provider`), the run's tokens, and the fleet
coordinator on one.

Each entry holds what its provider can do (provider_capabilities.py: how it attaches, its
worker kinds, its pause modes with a LoRA adapter, the fields only it reads), how to build it,
and what a config needs to attach to a fleet that is already running (`fleetrl status` only
queries; it never launches one). A run records its running fleet in its directory
(`start_recorded`), so `fleetrl status RUN_DIR` attaches with nothing else given
(`attached_to_run`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fleetrl.config import Config, ConfigError, InferenceConfig, secret_fields
from fleetrl.contract import ADMIN_TOKEN_ENV, DATA_TOKEN_ENV
from fleetrl.inference.dynamo.provider import DynamoProvider
from fleetrl.inference.fleet import AgreementProbe, Fleet, WeightSource
from fleetrl.inference.provider import InferenceProvider, WeightTransport
from fleetrl.inference.vllm.provider import VllmProvider
from fleetrl.lora import AdapterSpec
from fleetrl.provider_capabilities import PROVIDER_CAPABILITIES, ProviderCapabilities
from fleetrl.rundir import RunDir
from fleetrl.weights.checksum import checksum_of
from fleetrl.weights.factory import make_transport
from fleetrl.weights.target import UpdateTarget


@dataclass(frozen=True)
class Tokens:
    """The bearer tokens of native vLLM workers (engine/admin_auth.py); None: not known."""

    admin: str | None  # every route: pause, weights, versions, sampling
    data: str | None  # sampling only


def resolve_tokens(inference: InferenceConfig, *, draw_missing: bool,
                   environ: Mapping[str, str] = os.environ) -> Tokens:
    """Each token from its config field, else its environment variable, else — for a fleet that
    this process starts (`draw_missing`) — a fresh random one. Launched servers get them by
    environment only (vllm/launcher.py); attached servers must have been started with them."""
    def resolve(field: str, variable: str) -> str | None:
        token = getattr(inference, field) or environ.get(variable) or None
        return secrets.token_urlsafe(24) if token is None and draw_missing else token

    tokens = Tokens(admin=resolve("admin_token", ADMIN_TOKEN_ENV), data=resolve("data_token", DATA_TOKEN_ENV))
    if tokens.admin is not None and tokens.admin == tokens.data:
        raise ConfigError("the admin and data tokens are the same (inference.admin_token, inference.data_token or "
                          f"${ADMIN_TOKEN_ENV}, ${DATA_TOKEN_ENV}): whoever samples could then pause the workers "
                          "and replace their weights")
    return tokens


@dataclass(frozen=True)
class ProviderEntry:
    # What it can do, as the config's checks read it too (InferenceConfig.capabilities).
    capabilities: ProviderCapabilities
    # (config, run directory, model folder — None when only attaching —, tokens, whether the
    # provider is a run's: it labels and holds the workers under the run directory's run id;
    # else it only looks, the LoRA adapter its workers serve, None: the base model) -> provider
    build: Callable[[Config, RunDir, Path | None, Tokens, bool, AdapterSpec | None], InferenceProvider]
    # What the config lacks to attach to a running fleet, as "fleetrl status needs ..." ends; None: nothing.
    missing_to_attach: Callable[[InferenceConfig], str | None]


def _vllm(config: Config, run_dir: RunDir, model_dir: Path | None, tokens: Tokens, runs: bool,
          adapter: AdapterSpec | None) -> VllmProvider:
    return VllmProvider(config.inference, model_dir, run_dir.logs_dir, tokens.admin, tokens.data,
                        run_dir.run_id() if runs else None, adapter=adapter)


def _vllm_missing(inference: InferenceConfig) -> str | None:
    if not inference.urls:
        return "a run directory (fleetrl status RUN_DIR) or inference.urls (the workers to query)"
    if resolve_tokens(inference, draw_missing=False).admin is None:
        return (f"inference.admin_token or ${ADMIN_TOKEN_ENV}, the token the workers were started with "
                "(a run that fleetrl launched keeps it in RUN_DIR/tokens.json: fleetrl status RUN_DIR)")
    return None


def _dynamo(config: Config, run_dir: RunDir, model_dir: Path | None, tokens: Tokens, runs: bool,
            adapter: AdapterSpec | None) -> DynamoProvider:
    # Dynamo's frontend takes no token, and neither do the system ports (the RL admin routes) of
    # Dynamo's own worker kind: a token set for them would protect nothing, and saying nothing
    # would let the user think so. fleetrl's worker kind takes only calls signed with the admin
    # token (engine/dynamo_worker.py): launched workers get it by environment.
    inference = config.inference
    signed_admin = inference.worker_kind().signed_admin
    given = [f"inference.{name}" for name in ("admin_token", "data_token")
             if getattr(inference, name) and not (signed_admin and name == "admin_token")]
    if given:
        raise ConfigError(f"{' and '.join(given)} set with inference.provider = 'dynamo', whose "
                          f"{'frontend takes' if signed_admin else 'frontend and own worker kind take'} no token: unset "
                          "it, and protect those ports with the network (docs/dynamo.md, \"Protecting the system "
                          "port\")")
    if signed_admin:
        inference = inference.model_copy(update={"admin_token": tokens.admin})
    return DynamoProvider(inference, model_dir, run_dir.root, run_dir.run_id() if runs else None,
                          adapter=adapter)


def _dynamo_missing(inference: InferenceConfig) -> str | None:
    if not inference.dynamo.frontend_url:
        return ("a run directory (fleetrl status RUN_DIR) or inference.dynamo.frontend_url and "
                "inference.dynamo.rl_url (the deployment to query)")
    if inference.worker_kind().signed_admin and resolve_tokens(inference, draw_missing=False).admin is None:
        return (f"inference.admin_token or ${ADMIN_TOKEN_ENV}, the token fleetrl's worker kind was started with "
                "(a run that fleetrl launched keeps it in RUN_DIR/tokens.json: fleetrl status RUN_DIR)")
    return None


PROVIDERS: dict[str, ProviderEntry] = {
    "vllm": ProviderEntry(PROVIDER_CAPABILITIES["vllm"], build=_vllm, missing_to_attach=_vllm_missing),
    "dynamo": ProviderEntry(PROVIDER_CAPABILITIES["dynamo"], build=_dynamo, missing_to_attach=_dynamo_missing),
}


def build_provider(config: Config, run_dir: RunDir, model_dir: Path | None, tokens: Tokens, runs: bool = True,
                   adapter: AdapterSpec | None = None) -> InferenceProvider:
    """The configured provider, of the run in `run_dir` (config.run.dir: its logs, its run id);
    `runs` False: one that only looks at the workers (`fleetrl status`). `adapter`: the LoRA
    adapter its workers serve requests through (a LoRA run's)."""
    return PROVIDERS[config.inference.provider].build(config, run_dir, model_dir, tokens, runs, adapter)


def build_fleet(config: Config, run_dir: RunDir, model_dir: Path, adapter: AdapterSpec | None = None) -> Fleet:
    """The fleet coordinator on the configured provider, serving the model folder `model_dir`
    (the command's `resolve_model`); `run_dir`: the run directory whose run id labels and holds
    the workers, the very RunDir that then starts the run (a new run's id is drawn in it, and
    written by its start); `adapter`: the LoRA adapter the workers serve through (`fleetrl rl`
    of a LoRA run)."""
    inference = config.inference
    tokens = resolve_tokens(inference, draw_missing=True)
    provider = build_provider(config, run_dir, model_dir, tokens, adapter=adapter)
    return Fleet(provider, pause_mode=inference.resolved_pause_mode(),
                 discovery_interval_s=inference.discovery_interval_s, health_timeout_s=inference.health_timeout_s,
                 no_worker_timeout_s=inference.no_worker_timeout_s, probe_tolerance=inference.probe_tolerance,
                 max_restarts=inference.max_restarts, claim_trusted_s=inference.claim_trusted_s(),
                 publish=inference.publish, publish_wave=inference.publish_wave,
                 max_lag=config.orchestrator.max_off_policy_steps)


def build_transport(config: Config, run_dir: RunDir, target: UpdateTarget = "model") -> WeightTransport:
    """The weight transport of `inference.weights` (rank 0 is its sender); `target` "adapter":
    what it sends replaces the workers' LoRA adapter (a LoRA run's publishes)."""
    weights = config.inference.weights
    return make_transport(weights.transport, host=weights.sender_host, bucket_bytes=weights.bucket_mb << 20,
                          storage_dir=weights.dir or run_dir.weights_dir, timeout_s=weights.transfer_timeout_s,
                          backend=weights.backend, target=target)


def base_weights(provider: InferenceProvider, model_dir: Path, transport: WeightTransport,
                 version: int = 0) -> Callable[[], Awaitable[WeightSource]] | None:
    """What attached workers are held to before they are labelled `version` (`Fleet.start`
    awaits it once they answered), in a process with no trainer: the weights of the model in
    `model_dir` (`fleetrl inference`: the base, v0; `fleetrl eval`: the model it scores, at the
    checkpoint's step), their checksum, and their logprobs of the agreement probe. None where
    the provider launches its workers from `model_dir` itself. `fleetrl rl` takes them from the
    trainer's own copy instead (`RLRun.hand_start_weights`)."""
    if provider.launches_workers:
        return None

    async def load() -> WeightSource:
        # On the event loop's thread, the main one (asyncio.run): a model load sets process-wide
        # state (torch's default dtype, transformers' init patches; fleetrl/tripwire.py). It holds
        # the loop, where nothing runs yet but this start of attached workers.
        return _load_base_weights(model_dir, transport, version)

    return load


def _load_base_weights(model_dir: Path, transport: WeightTransport, version: int) -> WeightSource:
    """Loaded on the CPU, unsharded, and kept until the first publish replaces them: the same
    memory as the snapshot that every later publish keeps."""
    import torch

    from fleetrl.trainer.model import agreement_probe, load_policy, named_tensors, prompt_logprobs

    model = load_policy(model_dir, torch.device("cpu"), sharded=False).eval()
    tensors = dict(named_tensors(model))
    probe_ids = agreement_probe(model)
    probe = AgreementProbe(probe_ids, prompt_logprobs(model, probe_ids, torch.device("cpu")))
    return start_source(transport, tensors, probe, version)


def start_source(transport: WeightTransport, tensors: dict, probe: AgreementProbe, version: int) -> WeightSource:
    """The weights a run starts from (version 0, or a resumed checkpoint's), as the fleet
    refits workers with them until the first publish."""
    return WeightSource(transport, lambda: iter(tensors.items()), checksum_of(tensors.items()), probe, version)


async def start_recorded(fleet: Fleet, run_dir: RunDir,
                        weights: Callable[[], Awaitable[WeightSource]] | None) -> None:
    """Start the fleet (`weights`: see `Fleet.start`), then record in the run directory how to
    attach to it: where it runs (fleet.json) and its tokens (tokens.json, readable by this user
    alone). The run removes both when its fleet stops (`RunDir.forget_fleet`)."""
    await fleet.start(weights)
    settings = fleet.provider.attach_settings()
    secret = secret_fields(InferenceConfig)
    run_dir.record_fleet({k: v for k, v in settings.items() if k not in secret},
                         {k: v for k, v in settings.items() if k in secret and v})


def attached_to_run(config: Config, recorded: dict) -> Config:
    """`config`, attached to the fleet a run recorded: `recorded` is what `start_recorded` wrote
    (`RunDir.recorded_fleet`); its settings replace the config's, the rest stays."""
    inference = InferenceConfig.model_validate(_merged(config.inference.model_dump(), recorded))
    return config.model_copy(update={"inference": inference})


def _merged(base: dict, update: dict) -> dict:
    """`base` with `update`'s values; a table in both (inference.dynamo) is merged key by key."""
    return {**base, **{key: _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict)
                       else value for key, value in update.items()}}
