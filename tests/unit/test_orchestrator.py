"""The orchestrator against the in-process fake fleet: admission, drops, bad environments."""

import asyncio
import json
import math
import tempfile
from pathlib import Path

import pytest

from fleetrl.config import OrchestratorConfig
from fleetrl.envs import EnvError, Task
from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet import Fleet
from fleetrl.orchestrator.advantages import group_advantages
from fleetrl.orchestrator.rollouts import Orchestrator
from fleetrl.rundir import RunDir

from .fake_fleet import FakeProvider, FakeTransport


class Tokenizer:
    eos_token_id = 2

    def apply_chat_template(self, messages, **_):
        return [1] + [ord(c) % 50 + 3 for c in messages[-1]["content"]]

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


class Env:
    name = "fake"

    def __init__(self, reward=lambda rollout: (len(rollout.completion) % 7) / 7):
        self._reward = reward

    def tasks(self, seed):
        i = 0
        while True:
            yield Task(id=f"t{seed}-{i}", messages=[{"role": "user", "content": f"task {i}"}], answer=None)
            i += 1

    def reward(self, rollout):
        return self._reward(rollout)


async def make(k=0, env=None, step_s=0.001):
    run_dir = RunDir(Path(tempfile.mkdtemp(prefix="fleetrl-orch-")))
    provider = FakeProvider("a", "b", step_s=step_s)
    fleet = Fleet(provider, discovery_interval_s=3600, log=lambda *_: None)
    await fleet.start()
    config = OrchestratorConfig(max_off_policy_steps=k, batch_prompts=3, group_size=4, max_tokens=6)
    orch = Orchestrator(fleet, env or Env(), Tokenizer(), config, run_dir=run_dir, seed=0, log=lambda *_: None)
    return fleet, orch, FakeTransport(provider)


def weights():
    return iter([])


async def test_batch_has_groups_with_normalized_advantages():
    fleet, orch, _ = await make()
    batch = await orch.make_batch(1)
    assert len(batch.samples) == 12 and batch.dropped == 0
    assert sorted({s.group for s in batch.samples}) == [0, 1, 2]
    for g in range(3):
        advantages = [s.advantage for s in batch.samples if s.group == g]
        assert abs(sum(advantages)) < 1e-6
    assert batch.meta["distance_max"] == 0 and batch.meta["dispatch_version"] == 0
    await fleet.close()


async def test_admission_waits_for_the_version_k_allows():
    fleet, orch, transport = await make(k=0)
    pending = asyncio.create_task(orch.make_batch(2))  # needs version 1 first
    await asyncio.sleep(0.05)
    assert not pending.done()
    await fleet.publish(1, transport, weights)
    batch = await pending
    assert batch.meta["dispatch_version"] == 1 and batch.meta["distance_max"] == 0
    await fleet.close()


async def test_publish_mid_rollout_stays_within_the_bound():
    # k = 1 admits batch 3 at version 1; a publish of v2 mid-rollout splits spans, distance 1.
    fleet, orch, transport = await make(k=1, step_s=0.01)
    await fleet.publish(1, transport, weights)
    pending = asyncio.create_task(orch.make_batch(3))
    await asyncio.sleep(0.02)
    await fleet.publish(2, transport, weights)
    batch = await pending
    assert batch.dropped == 0 and batch.meta["distance_max"] == 1
    assert any(len(s.spans) == 2 for s in batch.samples)
    await fleet.close()


async def test_samples_over_the_bound_are_dropped_even_if_admission_failed(monkeypatch):
    """The packing check is the second line of defence: with admission bypassed, batch 3 at
    k = 0 sampled at v0 is 2 versions behind, so every sample is dropped and the batch is an error."""
    fleet, orch, _ = await make(k=0)

    async def no_admission(version):
        return None

    monkeypatch.setattr(fleet, "wait_for_version", no_admission)
    with pytest.raises(FleetrlError, match="batch 3 is empty: of 12 samples 12 exceeded orchestrator.max_off_policy_steps = 0 and 0 were"):
        await orch.make_batch(3)
    await fleet.close()


async def test_samples_from_a_worker_at_the_wrong_version_are_rejected_and_counted():
    fleet, orch, _ = await make(k=0)
    fleet.provider.engines["a"].version = 7  # changed weights behind the fleet's back
    batch = await orch.make_batch(1)
    records = [json.loads(line) for line in orch.run_dir.rollouts_path(1).read_text().splitlines()]
    rejected = [r for r in records if r["version_error"]]
    assert rejected and all(r["worker"] == "a" and not r["trained"] for r in rejected)
    assert batch.meta["misversioned"] == len(rejected) and batch.dropped == 0
    assert len(batch.samples) == 12 - len(rejected) and all(s.spans[0].version == 0 for s in batch.samples)
    trained = [r for r in records if r["trained"]]
    assert {r["worker"] for r in trained} == {"b"} and len(trained) == len(batch.samples)
    for g in {s.group for s in batch.samples}:
        assert abs(sum(s.advantage for s in batch.samples if s.group == g)) < 1e-6
    await fleet.close()


@pytest.mark.parametrize("reward, message", [
    (lambda r: 1 / 0, "raised ZeroDivisionError"),
    (lambda r: math.nan, "is nan, outside [0, 1]"),
    (lambda r: "good", "is 'good', not a number"),
])
async def test_bad_rewards_stop_the_batch_with_a_clear_error(reward, message):
    fleet, orch, _ = await make(env=Env(reward))
    with pytest.raises(EnvError, match=r"env fake: reward of task t0-\d+ " + message.replace("(", r"\(").replace("[", r"\[")):
        await orch.make_batch(1)
    await fleet.close()


def test_group_advantages():
    assert group_advantages([1.0, 0.0]) == [1.0, -1.0]
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=False) == [0.75, -0.25, -0.25, -0.25]
