"""Dynamo's two worker kinds, as one strategy object each: how a completion's versions are
asked for, read and attributed. The data client, the control client and the provider ask the
worker's kind (`DynamoWorkerControl.worker_kind`, learned from what the worker reports) rather
than test a flag; what each kind guarantees is declared in provider_capabilities.py.

- `FleetrlWorker` (inference.dynamo.worker = fleetrl) returns vLLM's per-token spans in
  `engine_data.weight_versions`, and vLLM's own finish reason, so that a completion cut by an
  abort-mode pause is told from a finished one: its answers need nothing more.
- `DynamosOwnWorker` attaches no version to its tokens: each completion gets the one version
  that its worker's fence record proves produced it (attribution.py), and one that cannot be
  attributed is sampled again. It asks the engine for nothing, as requests whose versions no
  one reads do (a readiness or adapter smoke request).
"""

from __future__ import annotations

from typing import Any, Protocol

from fleetrl.errors import FleetrlError
from fleetrl.inference.dynamo.attribution import FenceRecord, sequence_version, with_span
from fleetrl.inference.types import GenerateResponse


class DynamoWorkerKind(Protocol):
    token_versions: bool  # it reports the version of every token (pause_modes reads it)
    extra_fields: tuple[str, ...]  # asked of the frontend beyond the completion's ids and worker

    def check_engine_data(self, engine: dict[str, Any], worker_id: str, request_id: str, run: str | None) -> None:
        """Refuse an answer whose engine data lacks what this kind reports."""

    def finish_reason(self, reported: Any, engine: dict[str, Any]) -> Any:
        """The completion's finish reason, from the one the frontend reported."""

    def weight_versions(self, engine: dict[str, Any]) -> Any:
        """The engine's per-token record; None: the provider attributes the versions."""

    def dispatchable(self, at_dispatch: FenceRecord) -> bool:
        """Whether a request sent to a worker with this fence record can be attributed."""

    def attributed(self, responses: list[GenerateResponse], at_dispatch: FenceRecord,
                   at_receipt: FenceRecord) -> list[GenerateResponse] | None:
        """`responses` with their versions; None: they cannot be known (sample again)."""


class DynamosOwnWorker:
    token_versions = False
    extra_fields: tuple[str, ...] = ()

    def check_engine_data(self, engine: dict[str, Any], worker_id: str, request_id: str, run: str | None) -> None:
        pass  # it reports nothing there

    def finish_reason(self, reported: Any, engine: dict[str, Any]) -> Any:
        return reported

    def weight_versions(self, engine: dict[str, Any]) -> Any:
        return None

    def dispatchable(self, at_dispatch: FenceRecord) -> bool:
        return not at_dispatch.paused and at_dispatch.version is not None

    def attributed(self, responses: list[GenerateResponse], at_dispatch: FenceRecord,
                   at_receipt: FenceRecord) -> list[GenerateResponse] | None:
        version = sequence_version(at_dispatch, at_receipt)
        if version is None:
            return None
        return [r if r.answer_error else with_span(r, version) for r in responses]


class FleetrlWorker:
    token_versions = True
    extra_fields = ("engine_data",)

    def check_engine_data(self, engine: dict[str, Any], worker_id: str, request_id: str, run: str | None) -> None:
        if "weight_versions" not in engine:
            raise FleetrlError(f"worker {worker_id}: generate {request_id} returned no per-token "
                               "versions (engine_data.weight_versions): is it fleetrl's worker kind?")
        if run is None:
            raise FleetrlError(f"worker {worker_id}: a client of no run cannot check per-token versions")

    def finish_reason(self, reported: Any, engine: dict[str, Any]) -> Any:
        # Cut by a pause: Dynamo reports it as "stop".
        return "abort" if str(engine.get("engine_finish_reason")).startswith("abort") else reported

    def weight_versions(self, engine: dict[str, Any]) -> Any:
        return engine["weight_versions"]

    def dispatchable(self, at_dispatch: FenceRecord) -> bool:
        return True  # every token carries its version

    def attributed(self, responses: list[GenerateResponse], at_dispatch: FenceRecord,
                   at_receipt: FenceRecord) -> list[GenerateResponse] | None:
        return responses


DYNAMOS_OWN, FLEETRLS = DynamosOwnWorker(), FleetrlWorker()


def kind_reporting(token_versions: bool) -> DynamoWorkerKind:
    """The kind of a worker that says whether it reports per-token versions (get_weight_version)."""
    return FLEETRLS if token_versions else DYNAMOS_OWN
