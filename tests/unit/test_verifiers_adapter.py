"""The `verifiers` adapter against a real (small) verifiers v1 taskset package.

The taskset is written to a temporary folder and imported by id, exactly as verifiers loads
an installed environment package. Skipped when `verifiers` is not installed.
"""

import itertools
import json
import sys
import textwrap

import pytest

pytest.importorskip("verifiers.v1")

import verifiers.v1 as vf  # noqa: E402

from fleetrl.envs import EnvError, Rollout, get_environment, score, task_stream  # noqa: E402
from fleetrl.versions import VersionSpan  # noqa: E402

TASKSET = '''
import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "tiger"]


class EchoData(vf.TaskData):
    target: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=0.75)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.target)

    @vf.reward(weight=0.25)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 10)


class EchoConfig(vf.TasksetConfig):
    num_tasks: int = 3


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        for word in WORDS[: self.config.num_tasks]:
            yield EchoTask(EchoData(prompt=f"Say {word}.", system_prompt="Answer in one word.", target=word),
                           self.config.task)


__all__ = ["EchoTaskset"]
'''

BROKEN = '''
import verifiers.v1 as vf


class BrokenTask(vf.Task):
    @vf.reward
    async def boom(self, trace: vf.Trace) -> float:
        raise RuntimeError("the judge is down")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        yield BrokenTask(vf.TaskData(prompt="hi"), self.config.task)


__all__ = ["BrokenTaskset"]
'''

SANDBOXED = '''
import verifiers.v1 as vf


class SandboxTask(vf.Task):
    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class SandboxTaskset(vf.Taskset[SandboxTask, vf.TasksetConfig]):
    def load(self):
        yield SandboxTask(vf.TaskData(prompt="fix the bug"), self.config.task)


__all__ = ["SandboxTaskset"]
'''


@pytest.fixture(scope="module", autouse=True)
def tasksets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasksets")
    for module, source in [("fleetrl_vf_echo", TASKSET), ("fleetrl_vf_broken", BROKEN),
                           ("fleetrl_vf_sandbox", SANDBOXED)]:
        (root / f"{module}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(root))
    yield
    sys.path.remove(str(root))


def rollout(task, completion, spans=(VersionSpan(3, 0),), step=5):
    return Rollout(task=task, completion=completion, spans=list(spans), step=step)


def test_tasks_come_from_the_taskset_with_its_config_and_repeat_reshuffled():
    env = get_environment("verifiers:fleetrl-vf-echo", config={"num_tasks": 3})
    tasks = list(itertools.islice(task_stream(env, seed=0), 9))
    assert tasks[0].messages[0] == {"role": "system", "content": "Answer in one word."}
    assert tasks[0].messages[1]["role"] == "user" and tasks[0].messages[1]["content"].startswith("Say ")
    # Each pass holds every task once; passes are reshuffled, the same way for the same seed.
    for epoch in range(3):
        assert sorted(t.id for t in tasks[3 * epoch: 3 * epoch + 3]) == ["0", "1", "2"]
    again = list(itertools.islice(task_stream(env, seed=0), 9))
    assert [t.id for t in again] == [t.id for t in tasks]


def test_reward_is_the_weighted_sum_of_the_task_rewards():
    env = get_environment("verifiers:fleetrl-vf-echo")
    task = next(env.tasks(0))
    target = task.answer.data.target
    assert score(env, rollout(task, target)) == 1.0
    assert score(env, rollout(task, "no")) == 0.25
    assert score(env, rollout(task, "a much longer and wrong answer")) == 0.0


def test_episode_records_policy_provenance(tmp_path):
    path = tmp_path / "episodes.jsonl"
    env = get_environment("verifiers:fleetrl-vf-echo", episodes_path=path, run_id="run-7", run_name="smoke")
    task = next(env.tasks(0))
    spans = [VersionSpan(2, 0), VersionSpan(3, 4)]
    episode = env.episode(rollout(task, task.answer.data.target, spans=spans, step=4))

    assert episode.run == vf.TrainRunInfo(id="run-7", name="smoke",
                                          work=vf.TrainWorkInfo(step=4, policy=vf.PolicySpan(start=2, end=3)))
    trace = episode.traces[0]
    assert trace.info["fleetrl"] == {
        "step": 4, "version_spans": [{"version": 2, "start": 0}, {"version": 3, "start": 4}],
    }
    assert trace.last_reply == task.answer.data.target
    assert [m.role for m in trace.messages] == ["system", "user", "assistant"]
    assert trace.assistant_messages[0].content == task.answer.data.target  # marked as sampled

    # What a verifiers user reads back: one JSON line per scored rollout, with the run stamp.
    score(env, rollout(task, "wrong", spans=spans, step=4))
    (line,) = path.read_text().splitlines()
    loaded = vf.WireEpisode.model_validate(json.loads(line))
    assert loaded.run.work.policy == vf.PolicySpan(start=2, end=3)
    assert loaded.env.name == "verifiers:fleetrl-vf-echo"
    assert loaded.traces[0].reward == 0.25


async def test_reward_works_from_inside_a_running_event_loop():
    env = get_environment("verifiers:fleetrl-vf-echo")
    task = next(env.tasks(0))
    assert score(env, rollout(task, task.answer.data.target)) == 1.0


def test_a_raising_verifiers_reward_becomes_an_env_error():
    env = get_environment("verifiers:fleetrl-vf-broken")
    task = next(env.tasks(0))
    with pytest.raises(EnvError, match=r"^env verifiers:fleetrl-vf-broken: reward of task 0 raised .*judge is down"):
        score(env, rollout(task, "hello"))


def test_rewards_that_need_a_runtime_are_refused():
    env = get_environment("verifiers:fleetrl-vf-sandbox")
    task = next(env.tasks(0))
    with pytest.raises(EnvError, match=r"rewards \['tests_pass'\] need a verifiers runtime"):
        score(env, rollout(task, "done"))


def test_unknown_taskset_and_bad_config_name_the_env():
    with pytest.raises(EnvError, match=r"^env verifiers:no-such-taskset: cannot load the taskset"):
        get_environment("verifiers:no-such-taskset")
    with pytest.raises(EnvError, match=r"^env verifiers:fleetrl-vf-echo: config.num_tasks: Input should be"):
        get_environment("verifiers:fleetrl-vf-echo", config={"num_tasks": "many"})
    with pytest.raises(EnvError, match=r"^env verifiers:fleetrl-vf-echo: config.num_taks: Extra inputs are not"):
        get_environment("verifiers:fleetrl-vf-echo", config={"num_taks": 3})
