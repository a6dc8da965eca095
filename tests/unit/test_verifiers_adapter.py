"""The `verifiers` adapter against a real (small) verifiers v1 taskset package.

The taskset is written to a temporary folder and imported by id, exactly as verifiers loads
an installed environment package. Skipped when `verifiers` is not installed.
"""

import asyncio
import functools
import gc
import itertools
import json
import sys
import textwrap
import threading

import pytest

pytest.importorskip("verifiers.v1")

import verifiers.v1 as vf  # noqa: E402

from fleetrl.envs import (EnvError, Rollout, env_tools, get_environment, is_multi_turn, respond, score,  # noqa: E402
                          task_stream)
from fleetrl.envs.tools import parse_tool_calls  # noqa: E402
from fleetrl.versions import VersionSpan  # noqa: E402

from .test_episodes import ChatML  # noqa: E402
from .test_episodes import make as make_orchestrator  # noqa: E402

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


# A multi-turn taskset shipping its own Env: prompt-less tasks, the env's scripted user asks each
# question and asks again once after a wrong answer.
QUIZ = '''
import verifiers.v1 as vf
from verifiers.v1.types import content_text


class QuizData(vf.TaskData):
    questions: list[str]
    answers: list[str]


class QuizTask(vf.Task[QuizData]):
    @vf.stop
    async def too_long(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 4

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)

    @vf.reward(weight=0.5)
    async def solved(self, trace: vf.Trace) -> float:
        msgs = trace.messages
        solved = 0
        for q, a in zip(self.data.questions, self.data.answers):
            asked = [i for i, m in enumerate(msgs) if m.role == "user" and q in content_text(m.content)]
            if asked and any(m.role == "assistant" and a in (m.content or "") for m in msgs[asked[0]:]):
                solved += 1
        return solved / len(self.data.questions)

    @vf.reward(weight=0.5)
    async def first_try(self, trace: vf.Trace) -> float:
        return float(not any("Try again" in content_text(m.content) for m in trace.messages if m.role == "user"))


class QuizEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            for q, a in zip(task.data.questions, task.data.answers):
                seg = await chat.turn(q)
                if seg.terminated:
                    return
                if a not in seg.last_reply:
                    seg = await chat.turn(f"Not quite. Try again: {q}")
                    if seg.terminated:
                        return


class QuizTaskset(vf.Taskset[QuizTask, vf.TasksetConfig]):
    def load(self):
        yield QuizTask(QuizData(system_prompt="Answer briefly.", prompt=None,
                                questions=["What is 2+2?", "What is the capital of Italy?"], answers=["4", "Rome"]))


__all__ = ["QuizTaskset", "QuizEnv"]
'''

# A tool taskset (verifiers' plain SingleAgentEnv): the task's toolset is lent to the model.
TOOLS = '''
import verifiers.v1 as vf

FACTS = {"ada lovelace": "first published computer program", "alan turing": "Turing machine"}


class FactsToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "facts"

    @vf.tool
    def lookup(self, name: str) -> str:
        """Look up what a person or thing is known for."""
        return FACTS.get(name.strip().lower(), "no entry found")

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @vf.tool
    async def index(self, name: str) -> str:
        """The index (broken)."""
        raise RuntimeError("the index is gone")


class FactsTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class FactsData(vf.TaskData):
    answer: str


class FactsTask(vf.Task[FactsData, vf.State, FactsTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [FactsToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def looked_up(self, trace: vf.Trace) -> float:
        return float(self.data.answer.lower() in (trace.last_reply or "").lower())

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class FactsConfig(vf.TasksetConfig):
    task: FactsTaskConfig = FactsTaskConfig()


class FactsTaskset(vf.Taskset[FactsTask, FactsConfig]):
    def load(self):
        for entity, fact in FACTS.items():
            yield FactsTask(FactsData(prompt=f"What is {entity.title()} known for? Use facts_lookup.", answer=fact),
                            self.config.task)


__all__ = ["FactsTaskset"]
'''

LOUD = '''
import verifiers.v1 as vf


class LoudTask(vf.Task):
    @vf.reward
    async def too_much(self, trace: vf.Trace) -> float:
        return 1.5


class LoudEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            await chat.turn()


class LoudTaskset(vf.Taskset[LoudTask, vf.TasksetConfig]):
    def load(self):
        yield LoudTask(vf.TaskData(prompt="shout"), self.config.task)


__all__ = ["LoudTaskset", "LoudEnv"]
'''

CRASHING = '''
import verifiers.v1 as vf


class CrashEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            raise KeyError("the scenario file")


class CrashTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="go"), self.config.task)


__all__ = ["CrashTaskset", "CrashEnv"]
'''

DUO = '''
import verifiers.v1 as vf


class DuoConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    critic: vf.AgentConfig = vf.AgentConfig()


class DuoEnv(vf.Env[DuoConfig]):
    async def run(self, task, agents):
        await agents.solver.run(task)


class DuoTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="hi"), self.config.task)


__all__ = ["DuoTaskset", "DuoEnv"]
'''

STATEFUL = '''
import verifiers.v1 as vf


class CounterState(vf.State):
    count: int = 0


class CounterToolset(vf.Toolset[vf.ToolsetConfig, CounterState]):
    @vf.tool
    async def bump(self) -> int:
        """Count."""
        return 1


class CounterTask(vf.Task):
    @classmethod
    def toolsets(cls, config):
        return [CounterToolset(vf.ToolsetConfig())]


class CounterTaskset(vf.Taskset[CounterTask, vf.TasksetConfig]):
    def load(self):
        yield CounterTask(vf.TaskData(prompt="count"), self.config.task)


__all__ = ["CounterTaskset"]
'''

PER_TASK = '''
import verifiers.v1 as vf


class SeededToolset(vf.Toolset[vf.ToolsetConfig]):
    async def setup_task(self, task) -> None:
        self.seed = task.data.idx

    @vf.tool
    async def seed(self) -> int:
        """The seed."""
        return 1


class SeededTask(vf.Task):
    @classmethod
    def toolsets(cls, config):
        return [SeededToolset(vf.ToolsetConfig())]


class SeededTaskset(vf.Taskset[SeededTask, vf.TasksetConfig]):
    def load(self):
        yield SeededTask(vf.TaskData(prompt="seed"), self.config.task)


__all__ = ["SeededTaskset"]
'''

CONTAINED = '''
import verifiers.v1 as vf


class BoxTask(vf.Task):
    NEEDS_CONTAINER = True


class BoxTaskset(vf.Taskset[BoxTask, vf.TasksetConfig]):
    def load(self):
        yield BoxTask(vf.TaskData(prompt="build"), self.config.task)


__all__ = ["BoxTaskset"]
'''

RUNTIME_MULTI = '''
import verifiers.v1 as vf


class GradedTask(vf.Task):
    @vf.reward
    async def tests_pass(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class GradedEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            await chat.turn()


class GradedTaskset(vf.Taskset[GradedTask, vf.TasksetConfig]):
    def load(self):
        yield GradedTask(vf.TaskData(prompt="fix it"), self.config.task)


__all__ = ["GradedTaskset", "GradedEnv"]
'''


@pytest.fixture(scope="module", autouse=True)
def tasksets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasksets")
    for module, source in [("fleetrl_vf_echo", TASKSET), ("fleetrl_vf_broken", BROKEN),
                           ("fleetrl_vf_sandbox", SANDBOXED), ("fleetrl_vf_quiz", QUIZ), ("fleetrl_vf_tools", TOOLS),
                           ("fleetrl_vf_loud", LOUD), ("fleetrl_vf_crashing", CRASHING), ("fleetrl_vf_duo", DUO),
                           ("fleetrl_vf_stateful", STATEFUL), ("fleetrl_vf_per_task", PER_TASK),
                           ("fleetrl_vf_contained", CONTAINED), ("fleetrl_vf_runtime_multi", RUNTIME_MULTI)]:
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


# --- multi-turn and tool tasksets, driven the way fleetrl's episode loop drives them -------------


def in_thread(fn, *args):
    """`fn(*args)` in a worker thread with no event loop, as fleetrl calls environments."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), f"{fn} hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


def play(env, task, replies, name="e0", step=5):
    """fleetrl's turn loop without tokens: each reply is a model turn; tool calls go to the tools,
    other turns to `respond`, each call in a worker thread. Returns (messages, state, end)."""
    messages, state = list(task.messages), {"episode": name, "step": step}
    tools = {tool.name: tool for tool in env_tools(env)}
    for turn, reply in enumerate(replies, start=1):
        messages.append({"role": "assistant", "content": reply})
        if turn == len(replies):
            return messages, state, "max_turns"
        if calls := parse_tool_calls(reply, tools):
            messages += [{"role": "tool", "content": f"error: {c.error}" if c.error else
                          str(in_thread(functools.partial(tools[c.name].fn, **c.arguments)))} for c in calls]
            continue
        answer = in_thread(respond, env, task, messages, state)
        if answer is None:
            return messages, state, "done"
        messages += answer
    raise AssertionError("unreachable")


def turns_of(messages, task, width=10):
    """Made-up token positions: model turn i is [20 i, 20 i + width), with a publish inside turn 1."""
    n = sum(m["role"] == "assistant" for m in messages[len(task.messages):])
    turns = [[20 * i, 20 * i + width] for i in range(n)]
    spans = [VersionSpan(3, 0)] + [VersionSpan(4 if i == 1 else 5 if i > 1 else 3, 20 * i) for i in range(1, n)]
    if n > 1:
        spans.insert(2, VersionSpan(5, 25))  # the weights changed in the middle of turn 1
    return turns, spans


def finish(env, task, messages, state, end, step=5):
    in_thread(env.episode_ended, task, state, end)
    turns, spans = turns_of(messages, task)
    last = messages[-1]["content"] if messages[-1]["role"] == "assistant" else ""
    return Rollout(task=task, completion=last, spans=spans, step=step, messages=messages, state=state, turns=turns)


def quiz(**options):
    env = get_environment("verifiers:fleetrl-vf-quiz", **options)
    return env, next(env.tasks(0))


def test_only_tasksets_that_need_it_make_the_adapter_multi_turn():
    env, task = quiz()
    assert is_multi_turn(env) and env_tools(env) == []
    # The env ran up to the model's first turn to say what the prompt-less task opens with.
    assert task.messages == [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    tools = get_environment("verifiers:fleetrl-vf-tools")
    assert is_multi_turn(tools) and [t.name for t in env_tools(tools)] == ["facts_add", "facts_index", "facts_lookup"]
    echo = get_environment("verifiers:fleetrl-vf-echo")
    assert not is_multi_turn(echo) and env_tools(echo) == [] and not hasattr(echo, "episode_ended")


def test_a_multi_turn_episode_runs_the_tasksets_env_and_records_each_turns_policy(tmp_path):
    path = tmp_path / "episodes.jsonl"
    env, task = quiz(episodes_path=path, run_id="run-7", run_name="smoke")
    messages, state, end = play(env, task, ["It is 5.", "Sorry: 4.", "Rome.", "(never sampled)"])
    assert end == "done" and state["episode"] == "e0"
    assert messages[len(task.messages):] == [
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "Not quite. Try again: What is 2+2?"},
        {"role": "assistant", "content": "Sorry: 4."},
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ]
    rollout = finish(env, task, messages, state, end)
    assert score(env, rollout) == 0.5  # solved (0.5 x 1) + first try (0.5 x 0)

    (line,) = path.read_text().splitlines()
    episode = vf.WireEpisode.model_validate(json.loads(line))
    assert episode.run == vf.TrainRunInfo(id="run-7", name="smoke",
                                          work=vf.TrainWorkInfo(step=5, policy=vf.PolicySpan(start=3, end=5)))
    assert episode.env.name == "verifiers:fleetrl-vf-quiz" and episode.ok
    (trace,) = episode.traces
    assert trace.stop_condition == "user_closed" and trace.num_turns == 3 and trace.metrics["turns"] == 3.0
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert trace.info["fleetrl"]["turns"] == [
        {"node": 2, "tokens": [0, 10], "version_spans": [{"version": 3, "start": 0}],
         "policy": {"start": 3, "end": 3}},
        {"node": 4, "tokens": [20, 30], "version_spans": [{"version": 4, "start": 20}, {"version": 5, "start": 25}],
         "policy": {"start": 4, "end": 5}},
        {"node": 6, "tokens": [40, 50], "version_spans": [{"version": 5, "start": 40}],
         "policy": {"start": 5, "end": 5}},
    ]
    assert trace.info["fleetrl"]["step"] == 5
    assert "verifiers_session" not in state  # let go once scored


def test_an_episode_fleetrl_cuts_short_hands_the_env_its_last_turn():
    env, task = quiz()
    messages, state, end = play(env, task, ["4", "Paris"])  # max_turns = 2: "Paris" never reached respond
    rollout = finish(env, task, messages, state, end)
    assert score(env, rollout) == 0.75
    # Ended for its context (the env's question is the last message, the model never answered it).
    messages, state, _ = play(env, task, ["4", "Paris", "(never sampled)"])
    (trace,) = env.episode(finish(env, task, messages[:-1], state, "context")).traces
    assert trace.stop_condition == "context" and trace.num_turns == 2 and trace.reward == 0.25
    assert trace.messages[-1].content == "Not quite. Try again: What is the capital of Italy?"
    # One model turn only (max_turns = 1): respond never ran; reward opens and winds down the env.
    messages = [*task.messages, {"role": "assistant", "content": "4"}]
    rollout = Rollout(task=task, completion="4", spans=[VersionSpan(2, 0)], step=1, messages=messages,
                      state={"episode": "e1", "step": 1}, turns=[[0, 3]])
    episode = env.episode(rollout)
    (trace,) = episode.traces
    assert trace.stop_condition == "max_turns" and trace.num_turns == 1 and trace.reward == 0.75
    assert trace.info["fleetrl"]["turns"][0]["policy"] == {"start": 2, "end": 2}


def test_concurrent_episodes_of_one_task_keep_their_own_sessions():
    env, task = quiz()
    results = {}

    def episode(name, replies):
        messages, state, end = play(env, task, replies, name=name)
        results[name] = score(env, finish(env, task, messages, state, end))

    threads = [threading.Thread(target=episode, args=(f"e{i}", replies))
               for i, replies in enumerate([["4", "Rome", "x"], ["5", "4", "Rome", "x"], ["5", "5", "x"]] * 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert {name: results[name] for name in ["e0", "e1", "e2"]} == {"e0": 1.0, "e1": 0.5, "e2": 0.0}
    assert len(results) == 9


def test_tools_are_the_tasksets_toolsets_and_the_trace_records_their_calls(tmp_path):
    path = tmp_path / "episodes.jsonl"
    env = get_environment("verifiers:fleetrl-vf-tools", episodes_path=path)
    tools = {tool.name: tool for tool in env_tools(env)}
    assert tools["facts_lookup"].schema()["function"]["description"] == "Look up what a person or thing is known for."
    assert tools["facts_add"].parameters["required"] == ["a", "b"]
    task = next(t for t in env.tasks(0) if "Ada" in t.messages[-1]["content"])
    assert task.messages == [{"role": "user", "content": "What is Ada Lovelace known for? Use facts_lookup."}]
    call = '<tool_call>\n{"name": "facts_lookup", "arguments": {"name": "Ada Lovelace"}}\n</tool_call>'
    bad = '<tool_call>{"name": "facts_add", "arguments": {"a": "x", "b": 2}}</tool_call>'
    add = '<tool_call>{"name": "facts_add", "arguments": {"a": 40, "b": 2}}</tool_call>'
    unknown = '<tool_call>{"name": "facts_add", "arguments": {"a": 1, "c": 2}}</tool_call>'
    messages, state, end = play(env, task, [f"Let me look.\n{call}", f"{bad}\n{add}\n{unknown}",
                                            "It is the first published computer program.", "(never)"])
    assert end == "done"
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert results[0] == "first published computer program" and results[2] == "42"
    assert results[1].startswith("error: Error executing tool add: 1 validation error")  # the model's mistake
    assert results[3].startswith("error: bad arguments for facts_add")  # fleetrl's check, on the tool's signature
    assert score(env, finish(env, task, messages, state, end)) == 1.0

    (trace,) = vf.WireEpisode.model_validate(json.loads(path.read_text())).traces
    assert [m.role for m in trace.messages] == ["user", "assistant", "tool", "assistant", "tool", "tool", "tool",
                                               "assistant"]
    first, second = trace.messages[1], trace.messages[3]
    assert first.content == "Let me look." and [(c.id, c.name, json.loads(c.arguments)) for c in first.tool_calls] == [
        ("call_0", "facts_lookup", {"name": "Ada Lovelace"})]
    assert [c.name for c in second.tool_calls] == ["facts_add"] * 3
    assert [(m.tool_call_id, m.name) for m in trace.tool_messages] == [
        ("call_0", "facts_lookup"), ("call_1", "facts_add"), ("call_2", "facts_add"), ("call_3", "facts_add")]
    assert trace.metrics["tool_calls"] == 4.0 and trace.stop_condition == "agent_completed"
    assert [t["node"] for t in trace.info["fleetrl"]["turns"]] == [1, 3, 7]

    # Tool calls until max_turns: respond never ran; reward hands the env every turn at once.
    messages, state, end = play(env, task, [call, call])
    assert end == "max_turns"
    (trace,) = env.episode(finish(env, task, messages, state, end)).traces
    assert [(m.role, bool(getattr(m, "tool_calls", None))) for m in trace.messages] == [
        ("user", False), ("assistant", True), ("tool", False), ("assistant", True)]
    assert trace.stop_condition == "max_turns" and trace.reward == 0.0
    assert [t["policy"] for t in trace.info["fleetrl"]["turns"]] == [{"start": 3, "end": 3}, {"start": 4, "end": 5}]


def pending(env):
    """The tasks still alive on the adapter's private loop."""
    async def alive():
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    return asyncio.run_coroutine_threadsafe(alive(), env._loop).result(5)


def test_a_tool_that_raises_raises_so_fleetrl_ends_its_episode():
    env = get_environment("verifiers:fleetrl-vf-tools")
    tools = {tool.name: tool for tool in env_tools(env)}
    task = next(env.tasks(0))
    state = {"episode": "e0", "step": 1}
    (call,) = parse_tool_calls('<tool_call>{"name": "facts_index", "arguments": {"name": "x"}}</tool_call>', tools)
    assert call.error is None
    with pytest.raises(RuntimeError, match="^RuntimeError: the index is gone"):  # fleetrl: `tool_failed`
        in_thread(functools.partial(tools[call.name].fn, **call.arguments))
    in_thread(env.episode_ended, task, state, "tool_failed")
    assert pending(env) == []


def test_episode_ended_cancels_an_unfinished_session_without_scoring_it(caplog):
    env, task = quiz()
    messages, state = [*task.messages, {"role": "assistant", "content": "5"}], {"episode": "e0", "step": 1}
    assert in_thread(respond, env, task, messages, state) == [
        {"role": "user", "content": "Not quite. Try again: What is 2+2?"}]
    session = state["verifiers_session"]
    assert len(pending(env)) == 1  # Env.run, waiting for the model's next turn
    in_thread(env.episode_ended, task, state, "off_policy")
    assert "verifiers_session" not in state and session.finished.is_set() and pending(env) == []
    assert session.policy.trace.rewards == {}  # abandoned: never scored
    gc.collect()
    assert "Task was destroyed" not in caplog.text and "never retrieved" not in caplog.text


async def test_the_orchestrator_runs_a_verifiers_episode_from_its_event_loop(tmp_path):
    """fleetrl's own episode loop (fake fleet, a template of characters): every model turn says
    "4", so the quiz asks its second question, then again, and max_turns = 3 cuts it."""
    path = tmp_path / "episodes.jsonl"
    env = get_environment("verifiers:fleetrl-vf-quiz", episodes_path=path)
    fleet, orch, _ = await make_orchestrator(env, ChatML(says="4"), max_turns=3)
    batch = await orch.make_batch(1)
    assert len(batch.samples) == 4 and "off_policy" not in batch.meta.dropped_by
    rows = [json.loads(line) for line in orch.run_dir.rollouts_path(1).read_text().splitlines()]
    assert {(r["end"], r["reward"]) for r in rows} == {("max_turns", 0.25)}
    assert rows[0]["messages"][1] == {"role": "user", "content": "What is the capital of Italy?"}
    episodes = [vf.WireEpisode.model_validate(json.loads(line)) for line in path.read_text().splitlines()]
    assert len(episodes) == 4
    for episode, sample in zip(sorted(episodes, key=lambda e: e.traces[0].info["fleetrl"]["turns"][0]["tokens"]),
                               sorted(batch.samples, key=lambda s: s.turns)):
        stamps = episode.traces[0].info["fleetrl"]["turns"]
        assert [s["tokens"] for s in stamps] == sample.turns and episode.run.work.step == 1
        assert episode.traces[0].stop_condition == "max_turns"
    assert pending(env) == []
    await fleet.close()


def test_refusals_name_the_env_and_the_reason():
    for taskset, reason in [
        ("fleetrl-vf-duo", r"DuoEnv seats 2 agents \['solver', 'critic'\]; fleetrl plays exactly one"),
        ("fleetrl-vf-stateful", r"toolset CounterToolset keeps per-rollout state"),
        ("fleetrl-vf-per-task", r"toolset SeededToolset has a per-task setup_task"),
        ("fleetrl-vf-contained", r"its tasks need a container"),
    ]:
        with pytest.raises(EnvError, match=rf"^env verifiers:{taskset}: {reason}"):
            get_environment(f"verifiers:{taskset}")
    env = get_environment("verifiers:fleetrl-vf-runtime-multi")
    task = next(env.tasks(0))
    with pytest.raises(EnvError, match=r"rewards \['tests_pass'\] need a verifiers runtime"):
        in_thread(respond, env, task, [*task.messages, {"role": "assistant", "content": "done"}], {})


def test_a_reward_outside_0_1_and_an_env_that_raises_are_env_errors():
    env = get_environment("verifiers:fleetrl-vf-loud")
    task = next(env.tasks(0))
    messages, state, end = play(env, task, ["AAA", "(never)"])
    with pytest.raises(EnvError, match=r"^env verifiers:fleetrl-vf-loud: task 0: reward too_much is 1.5, outside"):
        score(env, finish(env, task, messages, state, end))
    env = get_environment("verifiers:fleetrl-vf-crashing")
    task = next(env.tasks(0))
    with pytest.raises(EnvError, match=r"^env verifiers:fleetrl-vf-crashing: on task 0, CrashEnv raised KeyError"):
        in_thread(respond, env, task, [*task.messages, {"role": "assistant", "content": "ok"}], {})
