"""An in-process provider and transport for fast, hermetic tests of the fleet coordinator.

The fake engine generates token by token, stamping each token with the version its weights
had at that step (token id = 1000 * version + position), so a test can read off exactly where
the weights changed. Pausing in `keep` mode holds generation; in `abort` mode it ends the
request with its partial output, as vLLM does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fleetrl.contract import RankWeights
from fleetrl.errors import FleetrlError
from fleetrl.inference.types import (GenerateRequest, GenerateResponse, UnversionedTokens, WorkerInfo,
                                     WorkerRole)
from fleetrl.versions import VersionSpan


@dataclass
class FakeEngine:
    id: str
    version: int | None = None  # None: never given a fleetrl version
    checksum: str | None = None  # None: received no weights since it started
    paused: bool = False
    pause_mode: str = "keep"
    alive: bool = True
    fail: set[str] = field(default_factory=set)  # admin operations that raise
    unpaused: asyncio.Event = field(default_factory=asyncio.Event)
    served: int = 0
    role: WorkerRole = WorkerRole.AGGREGATED
    prefilled: int = 0  # prompts it prefilled for another worker (role PREFILL)
    abandoned: int = 0  # updates it was told to close (one another coordinator may have left open)
    instance: str = ""  # the server instance it announces; "": its own, made from its id

    def __post_init__(self) -> None:
        self.unpaused.set()
        self.instance = self.instance or f"instance-of-{self.id}"


class FakeClient:
    """What a worker's clients share: its engine, which may be dead or fail an operation."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.worker_id = engine.id

    def _check(self, op: str) -> None:
        if not self.engine.alive:
            raise FleetrlError(f"worker {self.worker_id}: {op} failed: cannot connect")
        if op in self.engine.fail:
            raise FleetrlError(f"worker {self.worker_id}: {op} failed: injected")

    async def close(self) -> None:
        pass


class FakeControl(FakeClient):
    @property
    def instance(self) -> str:
        return self.engine.instance

    async def health(self) -> bool:
        return self.engine.alive

    async def is_paused(self) -> bool:
        self._check("is_paused")
        return self.engine.paused

    async def pause(self, mode: str) -> None:
        self._check("pause")
        self.engine.paused, self.engine.pause_mode = True, mode
        self.engine.unpaused.clear()

    async def resume(self) -> None:
        self._check("resume")
        self.engine.paused = False
        self.engine.unpaused.set()

    async def version(self) -> int | None:
        self._check("version")
        return self.engine.version

    async def set_version(self, version: int) -> None:
        self._check("set_version")
        self.engine.version = version

    async def weight_state(self) -> list[RankWeights]:
        return [RankWeights(checksum=self.engine.checksum)]

    async def in_flight(self) -> int | None:
        return None

    async def verify_weights(self, checksum: str | None) -> list[RankWeights]:
        self._check("verify_weights")
        if self.engine.checksum != checksum:
            raise FleetrlError(f"worker {self.worker_id}: checksum {self.engine.checksum} != sender's {checksum}")
        return await self.weight_state()


class FakeWeightSync(FakeClient):
    """The one weight-sync call the fleet makes itself; FakeTransport moves the weights without the others."""

    async def abandon(self, version: int) -> None:
        self._check("abandon")
        self.engine.abandoned += 1


class FakeProvider:
    name = "fake"

    def __init__(self, *ids: str, step_s: float = 0.002, launches_workers: bool = True) -> None:
        self.engines = {i: FakeEngine(i) for i in ids}
        self.launches_workers = launches_workers  # False: attached, held to the base checksum
        self.step_s = step_s
        self._clients: dict[str, tuple[FakeControl, FakeWeightSync]] = {}

    def add(self, worker_id: str, role: WorkerRole = WorkerRole.AGGREGATED) -> FakeEngine:
        self.engines[worker_id] = FakeEngine(worker_id, role=role)
        return self.engines[worker_id]

    async def start(self) -> None:
        pass

    async def discover(self) -> list[WorkerInfo]:
        return [WorkerInfo(id=e.id, data_url=f"fake://{e.id}", admin_url=f"fake://{e.id}", role=e.role)
                for e in self.engines.values() if e.alive]

    def admin(self, worker: WorkerInfo) -> FakeControl:
        return self._clients_of(worker)[0]

    def weight_sync(self, worker: WorkerInfo) -> FakeWeightSync:
        return self._clients_of(worker)[1]

    def _clients_of(self, worker: WorkerInfo) -> tuple[FakeControl, FakeWeightSync]:
        engine = self.engines[worker.id]
        if worker.id not in self._clients or self._clients[worker.id][0].engine is not engine:
            self._clients[worker.id] = FakeControl(engine), FakeWeightSync(engine)
        return self._clients[worker.id]

    async def generate(self, worker: WorkerInfo, request: GenerateRequest, prompt_suffix=(),
                       prefill=None) -> list[GenerateResponse]:
        engine = self.engines[worker.id]
        if prefill is not None:
            prefiller = self.engines[prefill.id]
            if not prefiller.alive:
                raise FleetrlError(f"worker {worker.id}: generate {request.request_id} failed: prefill worker "
                                   f"{prefill.id} gone")
            prefiller.prefilled += 1
        engine.served += 1
        return list(await asyncio.gather(*(self._sample(engine, request, len(prompt_suffix)) for _ in range(request.n))))

    async def _sample(self, engine: FakeEngine, request: GenerateRequest, already: int) -> GenerateResponse:
        if engine.version is None:  # vLLM labels such tokens "default", which engine_spans refuses
            raise UnversionedTokens(engine.id, request.request_id, "default", "fake-run")
        tokens: list[int] = []
        spans: list[VersionSpan] = []
        finish = "length"
        for i in range(request.sampling.max_tokens - already):
            while engine.paused:
                if engine.pause_mode == "abort":
                    finish = "abort"
                    break
                await engine.unpaused.wait()
            if finish == "abort":
                break
            if not engine.alive:
                raise FleetrlError(f"worker {engine.id}: generate {request.request_id} failed: connection lost")
            if not spans or spans[-1].version != engine.version:
                spans.append(VersionSpan(engine.version, i))
            tokens.append(1000 * engine.version + already + i)
            await asyncio.sleep(self.step_s)
        return GenerateResponse(request.request_id, tokens, [-0.5] * len(tokens), finish, engine.id, spans)

    async def close(self) -> None:
        pass


class FakeTransport:
    name = "fake"

    def __init__(self, provider: FakeProvider) -> None:
        self.provider = provider
        self.fail_worker: str | None = None  # this worker breaks the transfer
        self.kill_worker: str | None = None  # dies mid-transfer; a survivor reports the error
        self.corrupt_worker: str | None = None  # this worker ends with a wrong checksum
        self.transfers: list[tuple[list[str], int]] = []

    async def transfer(self, workers, named_tensors, version: int) -> str:
        ids = [w.worker_id for w in workers]
        self.transfers.append((ids, version))
        list(named_tensors())  # the transport consumes the weights
        if self.kill_worker in ids:
            self.provider.engines[self.kill_worker].alive = False
            self.kill_worker = None
            survivor = next(i for i in ids if self.provider.engines[i].alive)
            error = FleetrlError(f"worker {survivor}: update_weights failed: connection reset by peer")
            error.worker_id = survivor
            raise error
        for worker_id in ids:
            if worker_id == self.fail_worker:
                error = FleetrlError(f"worker {worker_id}: update_weights failed: injected")
                error.worker_id = worker_id
                raise error
        checksum = f"sum-v{version}"
        for worker_id in ids:
            engine = self.provider.engines[worker_id]
            engine.version = version
            engine.checksum = "garbage" if worker_id == self.corrupt_worker else checksum
        return checksum

    async def close(self) -> None:
        pass
