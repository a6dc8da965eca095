"""Which policy version produced a completion of a Dynamo worker that reports none.

fleetrl's worker kind returns vLLM's per-token spans, as a native server does, and needs
nothing here. Dynamo's own vLLM worker attaches no weight version to its tokens, so each of
its completions gets the one version that the worker's fence record proves produced it, and
a completion that cannot be attributed is sampled again rather than mis-versioned:

- the admin client keeps a `FenceRecord` of what the coordinator did to its worker (pauses,
  resumes, the version it set while paused);
- `sequence_version` compares the records at dispatch and at receipt;
- with prefill workers, `prefill_agrees` asks the same of the worker that computed the
  prompt's KV.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fleetrl.inference.types import GenerateResponse
from fleetrl.versions import VersionSpan


@dataclass(frozen=True)
class FenceRecord:
    """What the coordinator did to the worker, as seen by its admin client.

    `pauses` counts pause calls (counted before the call is sent), `resumes` resume calls
    (counted before they are sent); `paused` holds from the first until a resume
    succeeded; `version` is the version the worker was last set to, while paused.
    """

    pauses: int = 0
    resumes: int = 0
    paused: bool = False
    version: int | None = None

    def pausing(self) -> FenceRecord:
        """A pause call is about to be sent."""
        return replace(self, pauses=self.pauses + 1, paused=True)

    def resuming(self) -> FenceRecord:
        """A resume call is about to be sent."""
        return replace(self, resumes=self.resumes + 1)

    def resumed(self) -> FenceRecord:
        return replace(self, paused=False)

    def at_version(self, version: int | None) -> FenceRecord:
        """The worker was set to `version` (None: its weights are in flux)."""
        return replace(self, version=version)


def sequence_version(at_dispatch: FenceRecord, at_receipt: FenceRecord) -> int | None:
    """The one version that produced a whole completion, or None if it cannot be known.

    The coordinator changes a worker's version only while the worker is paused, and a paused
    engine produces no tokens. The completion was produced between dispatch and receipt, by
    a worker that was unpaused at dispatch, at version `at_dispatch.version`, so:
    - no pause began in between: every token came from that version;
    - pauses began but no resume was sent before receipt: the tokens all came before the
      first pause took effect, at that version too;
    - a resume was sent before receipt: the request may have waited out the pause and run
      on the new weights, or finished before it (a `wait` pause drains it), and nothing in
      the response says which.
    """
    if at_receipt.pauses == at_dispatch.pauses or at_receipt.resumes == at_dispatch.resumes:
        return at_dispatch.version
    return None


def with_span(response: GenerateResponse, version: int) -> GenerateResponse:
    """`response`, all of it attributed to `version`."""
    response.spans = [VersionSpan(version=version, start=0)]
    if response.token_ids:
        response.check()
    return response


def prefill_agrees(response: GenerateResponse, at_dispatch: dict[str, FenceRecord],
                   at_receipt: dict[str, FenceRecord]) -> bool:
    """Disaggregated serving: the prompt's KV came from a prefill worker (the one the fleet
    pinned, which the data client checks), so that worker's version over the request (its
    fence records by worker id, as for any worker without per-token versions) must be the
    completion's version. A prefill worker fleetrl has not refitted yet has no version, so
    its work is never accepted."""
    prefill = response.prefill_worker_id
    if prefill is None:
        return True
    before, after = at_dispatch.get(prefill), at_receipt.get(prefill)
    if before is None or after is None or before.paused:
        return False  # unknown, or paused at dispatch: it may have prefilled after the publish
    version = sequence_version(before, after)
    return version is not None and {span.version for span in response.spans} <= {version}
