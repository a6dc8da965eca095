"""`[inference]`: the provider and its workers, launched or attached, their time limits, admin
retries, tokens, restarts, claims and pause mode, with the vllm, dynamo and weights subsections;
and the rules both the config and the fleet apply (the pause modes that keep every token's
version exact, an admin call's backoff, the share of a claim's lease that is trusted, the
server a URL names)."""

from __future__ import annotations

import functools
import ipaddress
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from fleetrl.admin_signature import is_loopback
from fleetrl.config.dynamo import DynamoConfig
from fleetrl.config.section import MAX_WAIT_S, Section
from fleetrl.config.vllm import VllmConfig
from fleetrl.config.weights import WeightsConfig
from fleetrl.provider_capabilities import PROVIDER_CAPABILITIES, ProviderCapabilities, WorkerKind


# A failed admin call is tried again after ADMIN_BACKOFF_S, then twice as long before each next
# try (inference/http.py), at most ADMIN_RETRIES_MAX times: a publish waits these out while it
# holds the fence, so neither the count nor their sum may grow without bound.
ADMIN_RETRIES_MAX = 5
ADMIN_BACKOFF_S = 0.5

# The share of inference.claim_lease_s the fleet counts on its claim of a worker after a renewal
# was sent: the rest is slack for the two machines' clocks and a request sent as the check passes.
CLAIM_TRUSTED_SHARE = 0.9


def admin_backoff_s(attempt: int) -> float:
    """The wait after failed try `attempt` (0: the first) of an admin call, before the next."""
    return ADMIN_BACKOFF_S * 2**attempt


PauseMode = Literal["keep", "abort", "wait"]


def pause_modes(token_versions: bool, disaggregated: bool, adapter_refuses_keep: bool = False) -> tuple[PauseMode, ...]:
    """The pause modes that keep the version of every token exact; the first is the default.

    The one statement of this rule: the config resolves and checks `inference.pause_mode` with
    it, and a Dynamo worker's admin client checks each pause against what the worker reports.
    Without per-token versions (Dynamo's own worker) only `wait` is exact: in `keep` mode a
    request held across an update would mix versions with no record of where, and in `abort`
    mode Dynamo reports the cut request as finish_reason "stop", so it could not be told from
    a finished one and continued. With prefill workers apart from decode workers, a request
    held or cut while its KV is between them would resume on KV of the old weights. Some
    workers serving a LoRA adapter refuse a keep pause while requests through it run
    (`ProviderCapabilities.adapter_refuses_keep`: Dynamo's).
    """
    if not token_versions or disaggregated:
        return ("wait",)
    return ("abort", "wait") if adapter_refuses_keep else ("keep", "abort", "wait")


DEFAULT_PORTS = {"http": 80, "https": 443}


def server_address(url: str) -> tuple[str, str, int | None, str]:
    """The server a base URL reaches, known without the network: its scheme (http where none is
    written), host, port (the scheme's default where none is written) and path without a trailing
    slash. Host names are compared lower-case, addresses as addresses, and every loopback name and
    address (localhost, 127.0.0.0/8, ::1) is one host: a server bound to localhost or to every
    address answers on each."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{url!r} is not a URL: {e}") from None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").rstrip(".")
    if is_loopback(host):
        host = "localhost"
    else:
        try:
            host = ipaddress.ip_address(host).compressed
        except ValueError:
            pass  # a host name
    return scheme, host, port or DEFAULT_PORTS.get(scheme), parts.path.rstrip("/")


class InferenceConfig(Section):
    provider: Literal[tuple(PROVIDER_CAPABILITIES)] = Field(
        "vllm", description="Inference provider: native vLLM servers or an NVIDIA Dynamo deployment."
    )
    workers: int = Field(1, ge=1, description="Number of inference workers fleetrl launches (decode "
                         "workers when inference.dynamo.prefill_workers > 0).")
    urls: list[str] = Field(
        default_factory=list,
        description="Attach to servers started elsewhere (base URLs) instead of launching; "
        "overrides `workers`. Each server once: two spellings of one (localhost and 127.0.0.1, a trailing "
        "slash, a default port written out) are refused.",
    )
    host: str = Field(
        "127.0.0.1",
        description="Address launched servers bind to; loopback unless you mean to expose "
        "the admin routes.",
    )
    startup_timeout_s: float = Field(
        600.0, gt=0, le=MAX_WAIT_S, description="How long a launched worker may take to answer /health."
    )
    request_timeout_s: float = Field(
        300.0, gt=0, le=MAX_WAIT_S, description="Timeout of one generation request on the data plane."
    )
    admin_timeout_s: float = Field(
        60.0, gt=0, le=MAX_WAIT_S, description="Timeout of one admin call (pause, resume, version, weights)."
    )
    admin_retries: int = Field(
        2, ge=0, le=ADMIN_RETRIES_MAX,
        description=f"Retries of an admin call that failed to connect or timed out, at most {ADMIN_RETRIES_MAX}: "
        f"they wait {ADMIN_BACKOFF_S:g} s, then twice as long each time, "
        f"{sum(map(admin_backoff_s, range(ADMIN_RETRIES_MAX))):g} s in all at most, which a publish waits out "
        "holding its fence (besides each try's inference.admin_timeout_s).",
    )
    admin_token: str | None = Field(
        None,
        description="The token the admin routes (pause, weights, versions) require: native servers' and fleetrl's "
        "Dynamo worker kind's. fleetrl signs its calls with it and never sends it; an operator's curl may send it "
        "as a bearer token. Unset = $FLEETRL_ADMIN_TOKEN, else a fresh random token per run. Never written to "
        "config.toml.",
        json_schema_extra={"secret": True},
    )
    data_token: str | None = Field(
        None,
        description="Bearer token the data plane (sampling) requires; unset = $FLEETRL_DATA_TOKEN, "
        "else a fresh random token per run. Never written to config.toml.",
        json_schema_extra={"secret": True},
    )
    health_timeout_s: float = Field(
        10.0, gt=0, le=MAX_WAIT_S,
        description="Timeout of one health check: a worker that does not answer in time (hung, "
        "not dead) is taken out of routing and of the next publish fence.",
    )
    max_restarts: int = Field(
        3, ge=0,
        description="Restarts of launched workers that died or hung, over the whole run (a launched Dynamo "
        "worker is replaced by a new instance; a worker a discovery round misses but that still answers its "
        "health check is replaced only if the next round misses it too); a restarted worker is refitted and "
        "verified before it serves. A restart whose worker does not come up is given back.",
    )
    no_worker_timeout_s: float = Field(
        600.0, gt=0, le=MAX_WAIT_S,
        description="The run stops, naming each worker and its last error, when no worker has "
        "been ready for this long.",
    )
    probe_tolerance: float = Field(
        0.1, gt=0,
        description="Agreement probe after every publish: a worker whose prompt logprobs differ "
        "from the trainer's by more than this (max |delta|) is marked stale and refitted.",
    )
    pause_mode: PauseMode | None = Field(
        None,
        description="How a publish pauses workers: keep (in-flight requests continue on the new "
        "weights), abort (they are cut and continued), wait (drained first); unset = keep, or wait "
        "with inference.dynamo.worker = dynamo (no per-token versions) or "
        "inference.dynamo.prefill_workers > 0, or abort for fleetrl's Dynamo worker kind serving a LoRA "
        "adapter (trainer.lora), which refuses keep.",
    )
    publish: Literal["fenced", "rolling"] = Field(
        "fenced",
        description="How a new version reaches the workers: fenced (every worker paused, refitted, verified and "
        "probed together; the trainer waits for all of them) or rolling (in waves of inference.publish_wave "
        "workers, the first a canary; the rest of the fleet keeps serving the version it holds, and the trainer "
        "waits for the canary wave only, except at the run's last publish, one before an evaluation, and with a "
        "CUDA trainer, which reach every wave). See docs/reliability.md, \"Rolling publishes\".",
    )
    publish_wave: int = Field(
        1, ge=1,
        description="Workers per wave of a rolling publish (inference.publish = 'rolling'); with Dynamo prefill "
        "workers, decode workers per wave, each wave taking its share of the prefill workers (with fewer prefill "
        "workers than waves, fewer and larger waves). A wave as large as the fleet, or larger, is one fenced publish.",
    )
    discovery_interval_s: float = Field(
        5.0, gt=0, le=MAX_WAIT_S, description="How often the fleet re-discovers workers and checks their health."
    )
    claim_lease_s: float = Field(
        30.0, gt=0, le=MAX_WAIT_S,
        description="Workers (native vLLM servers and Dynamo workers alike) are held by one run at a time: each "
        "admin call of the run renews its claim for this long, and another run that reaches the worker meanwhile "
        "(attached to the same URL or Dynamo frontend) is refused, naming this one. A run that stops lets its "
        "workers go at once; one killed holds them this "
        "long, except from a resume of its own run directory. The run renews it every discovery_interval_s with a "
        "health check (even while discovery's listing fails) and routes nothing to a worker once "
        f"{CLAIM_TRUSTED_SHARE:g} of the lease has passed since its last renewal was sent, until the worker has "
        "been renewed and verified again: so at least (discovery_interval_s + 2 * health_timeout_s) / "
        f"{CLAIM_TRUSTED_SHARE:g} (a check is sent at most one interval and one timeout after the last, and "
        "answers within another timeout).",
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    dynamo: DynamoConfig = Field(default_factory=DynamoConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)

    @field_validator("urls")
    @classmethod
    def _one_entry_per_server(cls, urls: list[str]) -> list[str]:
        # Two entries of one server would be two workers: the first publish pauses it twice, and fails.
        seen: dict[tuple[str, str, int | None, str], str] = {}
        for url in urls:
            if (server := server_address(url)) in seen:
                raise ValueError(f"{seen[server]!r} and {url!r} name one server (the same scheme, host and port: "
                                 "every loopback name is one host); list each server once")
            seen[server] = url
        return urls

    @model_validator(mode="after")
    def _fields_fit_the_provider(self) -> "InferenceConfig":
        # Another provider's fields are refused: its attach fields naming how this one attaches,
        # the fields only it reads naming it (provider_capabilities.py declares both).
        mine = self.capabilities()
        for name, other in PROVIDER_CAPABILITIES.items():
            if name == self.provider:
                continue
            for field in other.own_fields:
                if self._value(field):
                    raise ValueError(f"inference.{field} is set but inference.provider is not {name!r}")
            for field in other.attach_fields:
                if self._value(field):
                    raise ValueError(f"inference.{field} is set but inference.provider is {self.provider!r}: to "
                                     f"attach to {mine.attaches_to} set {mine.attach_keys}")
        return self

    @model_validator(mode="after")
    def _shared_memory_needs_this_host(self) -> "InferenceConfig":
        # The shm transport's file is in this host's memory: a worker elsewhere would fail every publish.
        if self.weights.transport == "shm":
            for key, url in [("inference.urls", u) for u in self.urls] + [
                    (f"inference.dynamo.{name}", getattr(self.dynamo, name)) for name in ("frontend_url", "rl_url")]:
                if url and server_address(url)[1] != "localhost":
                    raise ValueError(f"inference.weights.transport 'shm' reaches workers on this host only, but "
                                     f"{key} names {url!r}: use broadcast or filesystem")
        return self

    @model_validator(mode="after")
    def _claim_outlasts_its_renewals(self) -> "InferenceConfig":
        renewal_s = self.discovery_interval_s + 2 * self.health_timeout_s
        if self.claim_trusted_s() < renewal_s:
            raise ValueError(f"inference.claim_lease_s ({self.claim_lease_s:g}) must be at least "
                             f"{renewal_s / CLAIM_TRUSTED_SHARE:g}: (inference.discovery_interval_s "
                             f"({self.discovery_interval_s:g}) + 2 * inference.health_timeout_s "
                             f"({self.health_timeout_s:g})) / {CLAIM_TRUSTED_SHARE:g}, or the run's workers would "
                             "leave its routing between the health checks that renew its claim on them")
        return self

    @model_validator(mode="after")
    def _waves_only_in_a_rolling_publish(self) -> "InferenceConfig":
        if self.publish_wave != 1 and self.publish != "rolling":
            raise ValueError(f"inference.publish_wave ({self.publish_wave}) is set but inference.publish is "
                             f"{self.publish!r}: waves are those of inference.publish = 'rolling'")
        return self

    @model_validator(mode="after")
    def _pause_mode_fits_workers(self) -> "InferenceConfig":
        if self.pause_mode is None or self.pause_mode in self._pause_modes():
            return self
        if not self.token_versions():
            caps = self.capabilities()
            reporting = [f"inference.{caps.worker_kind_field} = {name!r}"
                         for name, kind in caps.worker_kinds.items() if kind.token_versions]
            raise ValueError(f"inference.pause_mode {self.pause_mode!r} needs per-token versions, which "
                             f"{self.worker_kind().label} does not report: set {' or '.join(reporting)} "
                             "or inference.pause_mode = 'wait'")
        raise ValueError("inference.dynamo.prefill_workers needs inference.pause_mode = 'wait' (a request "
                         "held or cut while its KV is between prefill and decode would resume on KV of "
                         "the old weights)")

    def resolved_pause_mode(self) -> PauseMode:
        return self.pause_mode or self._pause_modes()[0]

    def attaches(self) -> bool:
        """Whether the fleet attaches to workers someone else started (inference.urls, or a Dynamo
        deployment's frontend_url) rather than launching its own: every trainer rank then takes
        part in handing the fleet the base weights (trainer/loop.py)."""
        return any(self._value(field) for field in self.capabilities().attach_fields)

    def capabilities(self) -> ProviderCapabilities:
        """What the configured provider can do (provider_capabilities.py)."""
        return PROVIDER_CAPABILITIES[self.provider]

    def worker_kind(self) -> WorkerKind:
        """The kind of worker the configured provider runs (for Dynamo: inference.dynamo.worker)."""
        caps = self.capabilities()
        if caps.worker_kind_field is None:
            (kind,) = caps.worker_kinds.values()
            return kind
        return caps.worker_kinds[self._value(caps.worker_kind_field)]

    def token_versions(self) -> bool:
        return self.worker_kind().token_versions

    def claim_trusted_s(self) -> float:
        """How long after a renewal of its claim on a worker was sent the run counts on it (Fleet)."""
        return self.claim_lease_s * CLAIM_TRUSTED_SHARE

    def admin_call_bound_s(self) -> float:
        """The longest one admin call takes: every try to its timeout, and the waits between them."""
        return self.admin_timeout_s * (self.admin_retries + 1) + sum(map(admin_backoff_s, range(self.admin_retries)))

    def _value(self, field: str) -> Any:
        """The value of a field named below `inference.` (`dynamo.frontend_url`)."""
        return functools.reduce(getattr, field.split("."), self)

    def _pause_modes(self) -> tuple[PauseMode, ...]:
        return pause_modes(self.token_versions(), disaggregated=self.dynamo.prefill_workers > 0)
