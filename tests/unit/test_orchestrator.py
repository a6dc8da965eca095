"""The orchestrator against the in-process fake fleet: admission, drops, bad environments."""

import asyncio
import dataclasses
import itertools
import json
import math
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fleetrl.config import OrchestratorConfig
from fleetrl.envs import EnvError, Task
from fleetrl.envs.mix import RunEnv
from fleetrl.errors import FleetrlError
from fleetrl.orchestrator import threads
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


async def make(k=0, env=None, step_s=0.001, log=lambda *_: None, envs=None, **options):
    run_dir = RunDir(Path(tempfile.mkdtemp(prefix="fleetrl-orch-")))
    provider = FakeProvider("a", "b", step_s=step_s)
    fleet = Fleet(provider, discovery_interval_s=3600, log=lambda *_: None)
    await fleet.start()
    config = OrchestratorConfig(max_off_policy_steps=k, batch_prompts=3, group_size=4, max_tokens=6, **options)
    env = env or Env()
    orch = Orchestrator(fleet, envs or [RunEnv(env.name, env)], Tokenizer(), config, run_dir=run_dir, seed=0, max_context=4096, log=log)
    return fleet, orch, FakeTransport(provider)


def records(orch, step):
    return [json.loads(line) for line in orch.run_dir.rollouts_path(step).read_text().splitlines()]


def weights():
    return iter([])


async def test_batch_has_groups_with_normalized_advantages():
    fleet, orch, _ = await make()
    batch = await orch.make_batch(1)
    assert len(batch.samples) == 12 and "off_policy" not in batch.meta.dropped_by
    assert sorted({s.group for s in batch.samples}) == [0, 1, 2]
    for g in range(3):
        advantages = [s.advantage for s in batch.samples if s.group == g]
        assert abs(sum(advantages)) < 1e-6
    assert batch.meta.distance_max == 0 and batch.meta.dispatch_version == 0
    await fleet.close()


async def test_admission_waits_for_the_version_k_allows():
    fleet, orch, transport = await make(k=0)
    pending = asyncio.create_task(orch.make_batch(2))  # needs version 1 first
    await asyncio.sleep(0.05)
    assert not pending.done()
    await fleet.publish(1, transport, weights)
    batch = await pending
    assert batch.meta.dispatch_version == 1 and batch.meta.distance_max == 0
    await fleet.close()


async def test_publish_mid_rollout_stays_within_the_bound():
    # k = 1 admits batch 3 at version 1; a publish of v2 mid-rollout splits spans, distance 1.
    fleet, orch, transport = await make(k=1, step_s=0.01)
    await fleet.publish(1, transport, weights)
    pending = asyncio.create_task(orch.make_batch(3))
    await asyncio.sleep(0.02)
    await fleet.publish(2, transport, weights)
    batch = await pending
    assert "off_policy" not in batch.meta.dropped_by and batch.meta.distance_max == 1
    assert any(len(s.spans) == 2 for s in batch.samples)
    await fleet.close()


async def test_samples_over_the_bound_are_dropped_even_if_admission_failed(monkeypatch):
    """The packing check is the second line of defence: with admission bypassed, batch 3 at
    k = 0 sampled at v0 is 2 versions behind, so every sample is dropped and the batch is an error."""
    fleet, orch, _ = await make(k=0)

    async def no_admission(version):
        return None

    monkeypatch.setattr(fleet, "wait_for_version", no_admission)
    admitted = fleet.routing._admitted  # each request's own bound bypassed too
    monkeypatch.setattr(fleet.routing, "_admitted", lambda min_version=None: admitted())
    with pytest.raises(FleetrlError, match="^batch 3 is empty: of 12 samples 12 exceeded orchestrator.max_off_policy_steps "
                                           "= 0, 0 were misversioned, 0 had a failed reward and 0 were empty$"):
        await orch.make_batch(3)
    assert {r["drop_reason"] for r in records(orch, 3)} == {"off_policy"}
    await fleet.close()


async def test_samples_from_a_worker_at_the_wrong_version_are_rejected_and_counted():
    fleet, orch, _ = await make(k=0)
    fleet.provider.engines["a"].version = 7  # changed weights behind the fleet's back
    batch = await orch.make_batch(1)
    written = records(orch, 1)
    rejected = [r for r in written if r["version_error"]]
    assert rejected and all(r["worker"] == "a" and not r["trained"] and r["drop_reason"] == "misversioned"
                            for r in rejected)
    assert batch.meta.dropped_by["misversioned"] == len(rejected) and "off_policy" not in batch.meta.dropped_by
    assert len(batch.samples) == 12 - len(rejected) and all(s.spans[0].version == 0 for s in batch.samples)
    trained = [r for r in written if r["trained"]]
    assert {r["worker"] for r in trained} == {"b"} and len(trained) == len(batch.samples)
    for g in {s.group for s in batch.samples}:
        assert abs(sum(s.advantage for s in batch.samples if s.group == g)) < 1e-6
    await fleet.close()


async def test_a_resumed_run_draws_the_tasks_an_uninterrupted_run_would():
    # k = 2 admits batches 1..3 at v0: no publish needed.
    fleet, uninterrupted, _ = await make(k=2)
    await uninterrupted.run(1, 3)
    tasks = {step: {r["task"] for r in records(uninterrupted, step)} for step in (1, 2, 3)}
    fleet, resumed, _ = await make(k=2)  # a fresh process: its task stream starts at task 0
    await resumed.run(3, 3)
    assert {r["task"] for r in records(resumed, 3)} == tasks[3]
    assert not tasks[3] & (tasks[1] | tasks[2])  # no prompt of steps 1..2 trained again
    await fleet.close()


class SeekingEnv(Env):
    """Env that can seek, counting the tasks it generates."""

    def __init__(self):
        super().__init__()
        self.generated = []

    def tasks(self, seed):
        return self.tasks_from(seed, 0)

    def tasks_from(self, seed, start):
        for task in itertools.islice(super().tasks(seed), start, None):  # the stream skipped, as it would be
            self.generated.append(task.id)
            yield task


async def test_a_resume_seeks_the_stream_without_generating_the_tasks_before_it():
    fleet, uninterrupted, _ = await make(k=2, env=SeekingEnv())
    await uninterrupted.run(1, 3)
    env = SeekingEnv()
    fleet2, resumed, _ = await make(k=2, env=env)
    await resumed.run(3, 3)
    assert [r["task"] for r in records(resumed, 3)] == [r["task"] for r in records(uninterrupted, 3)]
    assert env.generated == ["t0-6", "t0-7", "t0-8"]  # tasks 0..5 (steps 1 and 2) never made
    for f in (fleet, fleet2):
        await f.close()


def even_tasks_flat(rollout):
    """Tasks t0-0, t0-2, ... give every sample 0.5 (a group with no gradient); the others vary
    (the fake fleet's completions of one prompt are all alike, so at random)."""
    return 0.5 if int(rollout.task.id.rsplit("-", 1)[1]) % 2 == 0 else random.random()


async def test_dynamic_sampling_drops_flat_groups_and_samples_more_until_the_batch_is_full():
    fleet, orch, _ = await make(env=Env(even_tasks_flat), dynamic_sampling=True, dynamic_sampling_prompts=9)
    batch = await orch.make_batch(1)
    # t0 t1 t2: one group with a gradient, 2 missing -> t3 t4: one more, 1 missing -> t5.
    rollouts = records(orch, 1)
    assert sorted({r["task"] for r in rollouts}) == [f"t0-{i}" for i in range(6)]
    assert {r["task"] for r in rollouts if r["trained"]} == {"t0-1", "t0-3", "t0-5"}
    assert {r["task"] for r in rollouts if r["drop_reason"] == "filtered"} == {"t0-0", "t0-2", "t0-4"}
    assert batch.meta.sampled_prompts == 6 and batch.meta.filtered == 3
    assert batch.meta.dropped_by == {"filtered": 12}
    assert batch.meta.generated.samples == 24 and batch.meta.trained.samples == 12
    assert batch.meta.generated.reward_mean == pytest.approx(
        sum(r["reward"] for r in rollouts) / 24)
    assert batch.meta.trained.reward_mean == pytest.approx(
        sum(r["reward"] for r in rollouts if r["trained"]) / 12)
    assert len({s.group for s in batch.samples}) == 3 and all(s.advantage != 0 for s in batch.samples)
    await fleet.close()


async def test_dynamic_sampling_stops_at_its_bound_and_trains_the_groups_it_has():
    fleet, orch, _ = await make(k=1, env=Env(even_tasks_flat), dynamic_sampling=True, dynamic_sampling_prompts=4)
    batch = await orch.make_batch(1)
    assert batch.meta.sampled_prompts == 4 and batch.meta.filtered == 2
    assert {r["task"] for r in records(orch, 1) if r["trained"]} == {"t0-1", "t0-3"}
    # Step 2 draws from its own window of 4 tasks, t0-4 onwards, whatever step 1 left unused.
    await orch.make_batch(2)
    assert min(int(r["task"].rsplit("-", 1)[1]) for r in records(orch, 2)) == 4
    await fleet.close()


async def test_a_batch_whose_every_group_is_flat_trains_them_as_sampled():
    lines = []
    fleet, orch, _ = await make(env=Env(lambda rollout: 1.0), dynamic_sampling=True, log=lines.append)
    batch = await orch.make_batch(1)
    assert batch.meta.sampled_prompts == 9 and batch.meta.filtered == 0  # 3 x batch_prompts, then given up
    assert len(batch.samples) == 36 and all(s.advantage == 0 for s in batch.samples)
    assert any("the rewards of every group were equal" in line for line in lines), lines
    await fleet.close()


async def test_without_dynamic_sampling_a_flat_group_is_trained_and_nothing_more_is_sampled():
    fleet, orch, _ = await make(env=Env(even_tasks_flat))
    batch = await orch.make_batch(1)
    assert batch.meta.sampled_prompts == 3 and batch.meta.filtered == 0 and batch.meta.dropped_by == {}
    assert len(batch.samples) == 12
    await fleet.close()


HUNG = threading.Event()  # what a hung reward waits for; set at the end of each test


@pytest.fixture(autouse=True)
def release_hung_rewards():
    HUNG.clear()
    yield
    HUNG.set()


def hang(rollout):
    HUNG.wait()
    return 1.0


def every_third_sample(bad):
    """A reward that goes wrong (`bad`) on every third call, and varies otherwise."""
    calls = itertools.count()

    def reward(rollout):
        n = next(calls)
        return bad(rollout) if n % 3 == 0 else (n % 5) / 5

    return reward


def zero_division(rollout):
    return 1 / 0


def exits(rollout):
    sys.exit(3)


def interrupts(rollout):
    raise KeyboardInterrupt("in a reward")


@pytest.mark.parametrize("bad, error", [
    (zero_division, r"raised ZeroDivisionError: division by zero"),
    (lambda r: math.nan, r"is nan, outside \[0, 1\]"),
    (lambda r: math.inf, r"is inf, outside \[0, 1\]"),
    (lambda r: "good", r"is 'good', not a number"),
    (lambda r: None, r"is None, not a number"),
    (hang, r"took longer than orchestrator.reward_timeout_s = 2 s"),
    # Not errors to Python, but to the run they are: left as they were, they ended the control
    # loop that awaited them, and the run hung.
    (exits, r"raised SystemExit: 3"),
    (interrupts, r"raised KeyboardInterrupt: in a reward"),
])
async def test_a_failed_reward_drops_its_sample_and_the_batch_goes_on(bad, error):
    logged = []
    # 2 s, not less: on a loaded machine a good reward's thread once took longer to start than
    # 0.2 s, and failed as a hang (this test failed at random under the suite's load).
    fleet, orch, _ = await make(env=Env(every_third_sample(bad)), log=logged.append, reward_timeout_s=2)
    batch = await orch.make_batch(1)
    written = records(orch, 1)
    failed = [r for r in written if r["drop_reason"] == "reward_failed"]
    assert len(failed) == 4 and batch.meta.dropped_by["reward_failed"] == 4 and len(batch.samples) == 8
    for r in failed:
        assert not r["trained"] and r["reward"] is None and r["advantage"] is None
        assert re.fullmatch(f"env fake: reward of task {r['task']} {error}", r["reward_error"])
    # Advantages are relative to the samples of the group that have a reward.
    for g in {s.group for s in batch.samples}:
        assert abs(sum(s.advantage for s in batch.samples if s.group == g)) < 1e-6
    assert batch.meta.reward_mean == pytest.approx(sum(s.reward for s in batch.samples) / 8)
    (line,) = [m for m in logged if "reward failed" in m]  # once per batch
    assert line.startswith("fleetrl: batch 1: dropped 4 sample(s) whose reward failed (the first: env fake: reward of task")
    await fleet.close()


async def test_rewards_that_keep_hanging_end_the_run_instead_of_piling_up_threads(monkeypatch):
    """Python cannot stop a hung reward's thread; one per sample, without end, was the leak.
    With MAX_HUNG_CALLS of them alive, the next call ends the run, naming the last one given up."""
    monkeypatch.setattr(threads, "MAX_HUNG_CALLS", 3)
    monkeypatch.setattr(threads, "_hung", {})  # none left by an earlier test's hung rewards
    fleet, orch, _ = await make(k=1, env=Env(every_third_sample(hang)), reward_timeout_s=2)  # k = 1: no publish
    batch = await orch.make_batch(1)  # its 4 hung rewards dropped, the batch goes on
    assert batch.meta.dropped_by["reward_failed"] == 4 and len(threads._hung) == 4
    started = sum(t.name == "fleetrl-user-code" for t in threading.enumerate())
    with pytest.raises(threads.HungUserCode, match=r"^4 calls of user code still run past their time limits, each "
                                                   r"holding a thread that Python cannot stop \(the last given up "
                                                   r"on: env fake: reward of task t0-\d\); fix what hangs"):
        await orch.make_batch(2)
    assert sum(t.name == "fleetrl-user-code" for t in threading.enumerate()) == started  # batch 2 started none
    await fleet.close()


@pytest.mark.parametrize("hangs", ["task stream", "chat template"])
async def test_a_task_stream_or_chat_template_that_hangs_ends_the_run_naming_its_environment(monkeypatch, hangs):
    """Both ran on the loop that drives the fleet, with no time bound: one that hung stopped the
    run whole, the fleet's discovery included. Now each runs off the loop within
    orchestrator.task_timeout_s, and past it the run ends with one line (issue 36, item 9)."""
    monkeypatch.setattr(threads, "_hung", {})  # the given-up thread is this test's alone
    release = threading.Event()  # bounds the hang: on a loop it blocks, nothing else could end it

    class HangingEnv(Env):
        def tasks(self, seed):
            for task in super().tasks(seed):
                if task.id == "t0-2" and hangs == "task stream":
                    release.wait(10)
                yield task

    class HangingTokenizer(Tokenizer):
        def apply_chat_template(self, messages, **kw):
            if messages[-1]["content"] == "task 2" and hangs == "chat template":
                release.wait(10)
            return super().apply_chat_template(messages, **kw)

    fleet, orch, _ = await make(env=HangingEnv(), task_timeout_s=2)
    orch.tokenizer = HangingTokenizer()
    what = {"task stream": r"drawing tasks 0\.\.2 \(batch 1\)", "chat template": "rendering the prompt of task t0-2"}
    try:
        with pytest.raises(EnvError, match=rf"^env fake: {what[hangs]} took longer than "
                                           r"orchestrator.task_timeout_s = 2 s$"):
            await orch.make_batch(1)
    finally:
        release.set()
    await fleet.close()


async def test_a_batch_whose_rewards_all_fail_is_an_error_naming_the_first_failure():
    fleet, orch, _ = await make(env=Env(zero_division))
    with pytest.raises(FleetrlError, match=r"^batch 1 is empty: of 12 samples 0 exceeded .*, 12 had a failed reward "
                                           r"and 0 were empty \(the first failed reward: env fake: reward of task "
                                           r"t0-\d raised ZeroDivisionError: division by zero\)$"):
        await orch.make_batch(1)
    await fleet.close()


async def test_rewards_run_off_the_event_loop():
    """A slow reward runs in its own thread: the loop that drives the fleet keeps running while
    it sleeps (its ticks go on), and the batch's rewards overlap (several sleep at once). No
    clock is read: a loaded machine slows both sides alike."""
    ticks, running, overlapped, ticked = 0, 0, [], []
    lock = threading.Lock()

    def slow(rollout):
        nonlocal running
        with lock:
            running += 1
            overlapped.append(running)
        before = ticks
        time.sleep(0.1)
        ticked.append(ticks - before)
        with lock:
            running -= 1
        return 0.5

    fleet, orch, _ = await make(env=Env(slow))

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    ticker = asyncio.create_task(tick())
    batch = await orch.make_batch(1)
    ticker.cancel()
    assert len(batch.samples) == 12
    assert max(overlapped) > 1  # rewards ran at the same time
    assert max(ticked) > 0  # the loop ran while a reward slept
    await fleet.close()


async def test_an_empty_completion_is_dropped_and_counted(monkeypatch):
    logged = []
    fleet, orch, _ = await make(log=logged.append)
    generate = fleet.generate

    async def first_completion_empty(request):
        first, *others = await generate(request)
        return [dataclasses.replace(first, token_ids=[], logprobs=[], spans=[]), *others]

    monkeypatch.setattr(fleet, "generate", first_completion_empty)
    batch = await orch.make_batch(1)
    empty = [r for r in records(orch, 1) if r["drop_reason"] == "empty"]
    assert len(empty) == 3 and batch.meta.dropped_by["empty"] == 3 and len(batch.samples) == 9
    assert all(not r["trained"] and r["completion"] == "" and r["distance"] is None for r in empty)
    assert "fleetrl: batch 1: dropped 3 empty completion(s)" in logged
    await fleet.close()


def test_group_advantages():
    assert group_advantages([1.0, 0.0]) == [1.0, -1.0]
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=False) == [0.75, -0.25, -0.25, -0.25]



async def test_several_environments_each_give_whole_groups_and_are_reported_apart():
    flat, varied = Env(lambda rollout: 0.25), Env(lambda rollout: random.random())
    envs = [RunEnv("flat", flat, weight=1.0), RunEnv("varied", varied, weight=1.0)]
    fleet, orch, _ = await make(k=2, envs=envs)
    batch = await orch.make_batch(1)
    rollouts = records(orch, 1)
    by_group = {}
    for r in rollouts:
        by_group.setdefault(r["group"], set()).add((r["env"], r["task"].split("/")[0]))
    assert all(len(names) == 1 for names in by_group.values()), by_group  # a group is one environment's
    assert all(env == prefix for names in by_group.values() for env, prefix in names)  # ids say whose
    figures = batch.meta.envs
    assert sum(f.groups for f in figures.values()) == 3
    if "flat" in figures:
        assert figures["flat"].reward_mean == 0.25
    assert {s.env for s in batch.samples} == set(figures)
    # The same seed draws the same environments and tasks, and a resume skips to the same place.
    fleet2, again, _ = await make(k=2, envs=envs)
    await again.run(1, 3)
    assert [r["task"] for r in records(again, 1)] == [r["task"] for r in rollouts]
    fleet3, resumed, _ = await make(k=2, envs=envs)
    await resumed.run(3, 3)
    assert [r["task"] for r in records(resumed, 3)] == [r["task"] for r in records(again, 3)]
    for f in (fleet, fleet2, fleet3):
        await f.close()


def test_the_run_stream_draws_environments_by_weight_and_keeps_each_ones_order():
    from fleetrl.envs.mix import entry_seed, run_task_stream

    envs = [RunEnv("a", Env(), weight=3.0), RunEnv("b", Env(), weight=1.0)]
    drawn = list(itertools.islice(run_task_stream(envs, seed=7), 400))
    share = sum(d.env.name == "a" for d in drawn) / len(drawn)
    assert 0.65 < share < 0.85  # 3 : 1
    for name in ("a", "b"):
        own = [d.task.id for d in drawn if d.env.name == name]
        seed = entry_seed(7, name)  # each environment's own stream, in order, from a seed of its own
        assert own == [f"t{seed}-{i}" for i in range(len(own))]
        assert all(d.id == f"{name}/{d.task.id}" for d in drawn if d.env.name == name)
    one = list(itertools.islice(run_task_stream(envs[:1], seed=7), 3))
    assert [d.id for d in one] == ["t7-0", "t7-1", "t7-2"]  # one environment: its ids as they are


@pytest.mark.parametrize("seeks", [True, False])
def test_the_run_stream_from_a_position_is_the_stream_skipped_there(seeks):
    from fleetrl.envs.mix import run_task_stream

    def env():  # with tasks_from, or without it (generated and skipped)
        return SeekingEnv() if seeks else Env()

    for envs in ([RunEnv("a", env())], [RunEnv("a", env(), weight=3.0), RunEnv("b", env()), RunEnv("c", env())]):
        skipped = list(itertools.islice(run_task_stream(envs, seed=7), 50, 80))
        sought = list(itertools.islice(run_task_stream(envs, seed=7, start=50), 30))
        assert [(d.env.name, d.id, d.task) for d in sought] == [(d.env.name, d.id, d.task) for d in skipped]
    if seeks:  # task 50 of a mix, sought: its environment makes that task alone, the others none
        fresh = [RunEnv("a", env(), weight=3.0), RunEnv("b", env()), RunEnv("c", env())]
        drawn = next(run_task_stream(fresh, seed=7, start=50))
        assert [run_env.env.generated for run_env in fresh if run_env.env.generated] == [[drawn.task.id]]
        assert drawn.id == skipped[0].id
