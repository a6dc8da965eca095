"""What each inference provider can do, as data: one record per `inference.provider` name, and
one per worker kind it runs. A leaf, so that the config's checks (config/inference.py,
config/loader.py), the provider registry (app/providers.py) and the providers themselves read
the same record, and no code tests a provider's name: a new provider adds its record here and
its entry to the registry. Fields are named as the config names them below `inference.`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerKind:
    """One kind of worker a provider runs, and what it guarantees."""

    # As an error names it, where it lacks something.
    label: str
    # It reports the version of every token; else one exact version per completion, which only
    # the wait pause mode keeps (config/inference.py: pause_modes).
    token_versions: bool
    # Its admin routes take only calls signed with the run's admin token (engine/admin_auth.py,
    # engine/dynamo_worker.py); else they take no token, and the network must protect them.
    signed_admin: bool


@dataclass(frozen=True)
class ProviderCapabilities:
    """One provider: how a config attaches it to workers started elsewhere, the fields only it
    reads, its worker kinds and what its workers refuse."""

    # What it attaches to, as an error names it ("to attach to ...").
    attaches_to: str
    # The fields that attach it to workers started elsewhere, all set or none (each provider's
    # section checks that); set with another provider, they are refused naming this one's.
    attach_fields: tuple[str, ...]
    # Fields only this provider reads: set with another provider, they are refused naming it.
    own_fields: tuple[str, ...]
    # Its worker kinds, by the value of `worker_kind_field`; where that is None, its one kind.
    worker_kinds: Mapping[str, WorkerKind]
    worker_kind_field: str | None = None
    # Why a worker serving a LoRA adapter refuses the keep pause mode, as an error ends
    # "inference.pause_mode 'keep' with trainer.lora ..."; None: it takes every mode.
    adapter_refuses_keep: str | None = None

    @property
    def attach_keys(self) -> str:
        """The attach fields as a one-line error names them."""
        return " and ".join(f"inference.{field}" for field in self.attach_fields)


PROVIDER_CAPABILITIES: dict[str, ProviderCapabilities] = {
    "vllm": ProviderCapabilities(
        attaches_to="vLLM servers", attach_fields=("urls",), own_fields=(),
        worker_kinds={"vllm": WorkerKind("a native vLLM server", token_versions=True, signed_admin=True)}),
    "dynamo": ProviderCapabilities(
        attaches_to="a Dynamo deployment", attach_fields=("dynamo.frontend_url", "dynamo.rl_url"),
        own_fields=("dynamo.frontend_url", "dynamo.prefill_workers"),
        worker_kinds={"dynamo": WorkerKind("Dynamo's own worker", token_versions=False, signed_admin=False),
                      "fleetrl": WorkerKind("fleetrl's Dynamo worker kind", token_versions=True, signed_admin=True)},
        worker_kind_field="dynamo.worker",
        adapter_refuses_keep="on Dynamo: Dynamo's worker refuses a keep pause while requests through the adapter run"),
}
