"""`[inference.dynamo]`: the Dynamo deployment fleetrl launches or attaches to (its worker kind,
prefill workers, discovery, event plane and environment), read with inference.provider = dynamo."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fleetrl.config.section import Section
from fleetrl.provider_capabilities import PROVIDER_CAPABILITIES


class DynamoConfig(Section):
    """The Dynamo deployment fleetrl launches or attaches to (read with inference.provider = dynamo)."""

    worker: Literal[tuple(PROVIDER_CAPABILITIES["dynamo"].worker_kinds)] = Field(
        "dynamo",
        description="Dynamo worker kind: dynamo (Dynamo's own vLLM worker: one exact version per "
        "completion, inference.pause_mode wait only) or fleetrl (the same worker reporting the "
        "version of every token: any pause mode). In attach mode, the kind the deployment runs.",
    )
    frontend_url: str | None = Field(
        None,
        description="Attach mode: base URL of a running frontend's OpenAI API; unset = fleetrl "
        "launches a frontend and `inference.workers` workers.",
    )
    rl_url: str | None = Field(
        None,
        description="Attach mode: base URL of that frontend's RL discovery (its DYN_RL_PORT; "
        "fleetrl reads GET /v1/rl/workers).",
    )
    namespace: str | None = Field(
        None, description="Dynamo namespace of the launched frontend and workers (DYN_NAMESPACE); unset = "
        "fleetrl-<the run's id (drawn at its first start, kept in its run directory)>, one per run, so that runs "
        "sharing an etcd never see each other's workers.",
    )
    components: list[str] = Field(
        default_factory=lambda: ["backend", "prefill"],
        description="Components whose RL workers the launched frontend lists (DYN_RL_COMPONENTS); "
        "dynamo.vllm registers aggregated and decode workers as `backend`, prefill workers as `prefill`.",
    )
    prefill_workers: int = Field(
        0, ge=0,
        description="Prefill workers launched beside `inference.workers` decode workers (disaggregated "
        "serving through the frontend's prefill router); 0 = `inference.workers` aggregated workers.",
    )
    kv_transfer_config: dict[str, Any] | None = Field(
        None,
        description="KV connector of launched prefill/decode workers (vLLM --kv-transfer-config, "
        "kv_role defaults to kv_both); unset = vLLM's shared-storage connector with its store in "
        "RUN_DIR/kv-store (one machine; what runs on a CPU). On GPUs e.g. {kv_connector = \"NixlConnector\"}.",
    )
    discovery: Literal["file", "etcd", "kubernetes"] = Field(
        "file",
        description="Discovery backend of launched Dynamo processes (DYN_DISCOVERY_BACKEND): file "
        "(a folder in the run dir; one machine), etcd (workers register under leases that expire "
        "when they die), or kubernetes.",
    )
    etcd_endpoints: list[str] = Field(
        default_factory=list,
        description="etcd endpoints for inference.dynamo.discovery = etcd (ETCD_ENDPOINTS); unset = "
        "fleetrl launches an etcd of its own on loopback (data in RUN_DIR/etcd) and stops it with "
        "the deployment.",
    )
    event_plane: Literal["zmq", "nats"] = Field(
        "zmq",
        description="Event plane of launched Dynamo processes (DYN_EVENT_PLANE: KV events, load "
        "metrics): zmq (peer to peer, no server) or nats (through a NATS server: NATS_SERVER in "
        "inference.dynamo.env, else fleetrl launches one on loopback). Only nats connects to NATS.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment for every launched Dynamo process (e.g. NATS_SERVER, "
        "POD_NAMESPACE); overrides fleetrl's own settings.",
    )
    allow_unauthenticated_admin: bool = Field(
        False,
        description="Let launched Dynamo workers bind their system port (the RL admin routes, which "
        "take no token) to inference.host when it is not loopback; protect the port with a network "
        "policy (docs/dynamo.md).",
    )

    @model_validator(mode="after")
    def _fields_fit(self) -> "DynamoConfig":
        if (self.frontend_url is None) != (self.rl_url is None):
            raise ValueError("inference.dynamo.frontend_url and inference.dynamo.rl_url: set both "
                             "(attach to a running Dynamo deployment) or neither (launch one)")
        if self.etcd_endpoints and self.discovery != "etcd":
            raise ValueError("inference.dynamo.etcd_endpoints is set but inference.dynamo.discovery is not 'etcd'")
        return self
