"""Run a `verifiers` (v1 API) taskset as a fleetrl environment, and record what produced each rollout.

`verifiers:<taskset id>` loads the taskset the way verifiers does; fleetrl samples every model
turn. Single-turn tasksets are scored by their own `@vf.reward`s; a taskset with its own `Env` or
toolsets runs multi-turn, verifiers' `Env` driving the conversation on the adapter's loop
(`verifiers_bridge.py`). Each scored rollout becomes a verifiers `Episode` stamped with the policy
versions that produced it. What is supported, what is recorded and what is refused:
docs/environments.md, "`verifiers` tasksets". `verifiers` is imported only when such an
environment is built."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from fleetrl.envs.base import EnvError, Rollout, Task
from fleetrl.envs.verifiers_bridge import Session, check_toolsets, load_tools
from fleetrl.errors import one_line
from fleetrl.files import append_line

if TYPE_CHECKING:
    import verifiers.v1 as vf

UNSUPPORTED = "fleetrl's verifiers adapter does not provide"
SESSION = "verifiers_session"  # where an episode's verifiers session lives in fleetrl's `state`
ENDED = "verifiers_end"  # how fleetrl ended the episode (`episode_ended`)
SCORED_ENDS = ("done", "max_turns", "context")  # the ends fleetrl scores; the others are faults
TOOL_TIMEOUT_S = 30.0


def _import_verifiers():
    if importlib.util.find_spec("verifiers") is None:
        raise EnvError(
            "verifiers environments need the 'verifiers' package, which scripts/setup.sh installs: "
            "pip install -e '.[verifiers]'"
        )
    import verifiers.v1 as vf

    return vf


class VerifiersEnvironment:
    def __init__(
        self,
        taskset_id: str,
        config: dict[str, Any] | None = None,
        episodes_path: str | Path | None = None,
        run_id: str = "fleetrl",
        run_name: str | None = None,
    ) -> None:
        """`config`: the taskset's own config fields (its `TasksetConfig` subclass), e.g.
        `{"num_tasks": 100}`; `run_id`/`run_name` identify the training run on every episode."""
        self.name = f"verifiers:{taskset_id}"
        self._vf = vf = _import_verifiers()
        from verifiers.v1.utils.loaders import taskset_config_type

        try:
            taskset_config = taskset_config_type(taskset_id).model_validate({**(config or {}), "id": taskset_id})
            self.taskset = vf.load_taskset(taskset_config)
        except ValidationError as e:
            error = e.errors()[0]
            key = ".".join(str(part) for part in error["loc"])
            raise EnvError(f"env {self.name}: config.{key}: {error['msg']}") from None
        except Exception as e:
            raise EnvError(f"env {self.name}: cannot load the taskset: {one_line(e)}") from e
        task_cls = self.taskset.task_type()
        if task_cls.NEEDS_CONTAINER:
            raise EnvError(f"env {self.name}: its tasks need a container, which {UNSUPPORTED}")
        self.episodes_path = Path(episodes_path) if episodes_path is not None else None
        self.run_id = run_id
        self.run_name = run_name
        # verifiers is asynchronous; the orchestrator may call `reward` from inside its own event
        # loop, where `asyncio.run` is refused. One private loop thread serves every episode.
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name=f"{self.name} scoring", daemon=True).start()
        self._write_lock = threading.Lock()  # rewards are scored in threads: one line at a time
        self.env = None  # the taskset's verifiers `Env`, for multi-turn and tool tasksets
        self._openings: dict[str, list[dict[str, str]]] = {}  # prompt-less tasks: what the env opens with
        toolsets = [*self.taskset.toolsets(self.taskset.config), *task_cls.toolsets(self.taskset.config.task)]
        from verifiers.v1.utils.loaders import environment_class

        if toolsets or environment_class(taskset_id) is not vf.SingleAgentEnv:
            self._multi_turn(taskset_config, toolsets)

    def _multi_turn(self, taskset_config, toolsets: list) -> None:
        """Drive the taskset's own `Env` turn by turn (`respond`), lending its toolsets as tools."""
        vf = self._vf
        from verifiers.v1.configs.agent import agent_config_fields

        try:
            self.env = vf.load_environment(vf.resolve_env_config({"taskset": taskset_config}))
        except Exception as e:
            raise EnvError(f"env {self.name}: cannot build its verifiers Env: {one_line(e)}") from e
        seats = list(agent_config_fields(self.env.config))
        if len(seats) != 1:
            raise EnvError(f"env {self.name}: {type(self.env).__name__} seats {len(seats)} agents {seats}; fleetrl "
                           "plays exactly one, the trainable seat, and provides no model for the others")
        check_toolsets(self.name, toolsets)
        self.taskset = self.env.taskset
        try:
            tools = asyncio.run_coroutine_threadsafe(
                load_tools(self.name, toolsets, self._loop, TOOL_TIMEOUT_S), self._loop).result(60)
        except Exception as e:
            raise EnvError(f"env {self.name}: cannot serve its toolsets: {one_line(e)}") from e
        if len({tool.name for tool in tools}) != len(tools):
            raise EnvError(f"env {self.name}: two of its tools share a name ({[t.name for t in tools]})")
        # fleetrl treats an environment with `respond` as multi-turn: these exist only here.
        self.tools = tools
        self.respond = self._respond
        self.episode_ended = self._episode_ended

    def tasks(self, seed: int) -> Iterator[Task]:
        """A finite taskset is reshuffled every pass (seeded); an infinite one is its own
        stream, which verifiers does not seed: every seed then yields the same tasks."""
        make = self._task if self.env is None else self._multi_turn_task
        if not self.taskset.bounded:
            for vf_task in self.taskset:
                yield make(vf_task)
            return
        if self.env is None:
            tasks = [make(vf_task) for vf_task in self.taskset]
        else:  # the env may have to run to say what a task opens with: only as each is handed out
            tasks = list(self.taskset)
        if not tasks:
            raise EnvError(f"env {self.name}: the taskset has no tasks")
        rng = random.Random(seed)
        while True:
            for task in rng.sample(tasks, len(tasks)):
                yield task if self.env is None else make(task)

    def reward(self, rollout: Rollout) -> float:
        episode = self.episode(rollout)
        if self.episodes_path is not None:
            line = json.dumps(episode.to_record())
            with self._write_lock:
                append_line(self.episodes_path, line)
        return _trainable(episode).reward

    def episode(self, rollout: Rollout) -> vf.Episode:
        """The scored verifiers `Episode` of one rollout, stamped with its policy provenance."""
        if self.env is not None:
            return self._multi_turn_episode(rollout)
        vf = self._vf
        from verifiers.v1.state import state_cls

        vf_task = rollout.task.answer
        if unscorable := [fn.__name__ for fn in vf_task.hooks("reward") if _needs_runtime(fn)]:
            raise EnvError(f"env {self.name}: rewards {unscorable} need a verifiers runtime, which {UNSUPPORTED}")
        record = vf.TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash)
        trace = vf.Trace(
            task=record,
            state=state_cls(type(vf_task))(),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="fleetrl"),
        )
        messages = [*_prompt_messages(vf, vf_task.data), vf.AssistantMessage(content=rollout.completion)]
        for i, message in enumerate(messages):
            trace.nodes.append(
                vf.MessageNode(parent=i - 1 if i else None, message=message, sampled=i == len(messages) - 1)
            )
        versions = [span.version for span in rollout.spans]
        trace.info["fleetrl"] = {
            "step": rollout.step,
            "version_spans": [{"version": s.version, "start": s.start} for s in rollout.spans],
        }
        trace.ok = True
        trace.stop("agent_completed")
        asyncio.run_coroutine_threadsafe(vf_task.score(trace), self._loop).result()

        env = vf.EnvInfo(id=self.taskset.config.id, name=self.name)
        episode = vf.Episode(env=env, task=record, traces=[trace], ok=True)
        policy = vf.PolicySpan(start=min(versions), end=max(versions))
        work = vf.TrainWorkInfo(step=rollout.step, policy=policy)
        episode.record_run(vf.TrainRunInfo(id=self.run_id, name=self.run_name, work=work))
        return episode

    def _task(self, vf_task) -> Task:
        data = vf_task.data
        messages = _prompt_messages(self._vf, data)
        if not any(m.role == "user" for m in messages):
            raise EnvError(f"env {self.name}: task {data.idx} has no prompt (the user opens), which {UNSUPPORTED}")
        from verifiers.v1.types import content_text

        return Task(
            id=data.id or str(data.idx),
            messages=[{"role": m.role, "content": content_text(m.content)} for m in messages],
            answer=vf_task,
        )


    # --- multi-turn and tool tasksets: the taskset's own `Env`, driven turn by turn ------------------

    def _multi_turn_task(self, vf_task) -> Task:
        from verifiers.v1.types import content_text

        data = vf_task.data
        task_id = data.id or str(data.idx)
        if data.prompt is not None:
            messages = [{"role": m.role, "content": content_text(m.content)} for m in _prompt_messages(self._vf, data)]
        elif type(self.env) is self._vf.SingleAgentEnv:
            raise EnvError(f"env {self.name}: task {data.idx} has no prompt (the user opens), which {UNSUPPORTED} "
                           "without an Env of its own that opens the conversation")
        else:  # what the env opens with: run it up to the model's first turn, once per task
            if task_id not in self._openings:
                session = self._session(vf_task, task_id)
                try:
                    self._openings[task_id] = session.open()
                finally:
                    session.cancel()
            messages = self._openings[task_id]
        return Task(id=task_id, messages=messages, answer=vf_task)

    def _session(self, vf_task, task_id: str) -> Session:
        if unscorable := [fn.__name__ for fn in vf_task.hooks("reward") if _needs_runtime(fn)]:
            raise EnvError(f"env {self.name}: rewards {unscorable} need a verifiers runtime, which {UNSUPPORTED}")
        return Session(self._vf, self.name, self.env, vf_task, self._loop, task_id)

    def _open(self, task: Task, state: dict[str, Any]) -> Session:
        """The episode's session (in its `state`), opened at its first turn: the env runs up to
        the model's first turn, which must see the task's messages."""
        session = state.get(SESSION)
        if session is None:
            session = state[SESSION] = self._session(task.answer, task.id)
            opening = session.open()
            if opening != task.messages:
                session.cancel()
                raise EnvError(f"env {self.name}: task {task.id} opened with {str(opening)[:200]!r}, not its "
                               "messages: its Env must open every episode of a task the same way")
        return session

    def _respond(self, task: Task, messages: list[dict[str, str]], state: dict[str, Any]) -> list[dict[str, str]] | None:
        """The env's answer to the model's turn (`Env.run` goes on until it asks the model again)."""
        return self._open(task, state).respond(messages)

    def _episode_ended(self, task: Task, state: dict[str, Any], end: str) -> None:
        """A faulted episode is never scored: its `Env.run` is cancelled here. A scored one is
        wound down by `reward`, which hands the env the model's last turn."""
        state[ENDED] = end
        if end not in SCORED_ENDS and (session := state.pop(SESSION, None)) is not None:
            session.cancel()

    def _multi_turn_episode(self, rollout: Rollout) -> vf.Episode:
        vf, task, state = self._vf, rollout.task, rollout.state
        session = self._open(task, state)  # a one-turn episode (max_turns = 1) never reached `respond`
        messages = rollout.messages or [*task.messages, {"role": "assistant", "content": rollout.completion}]
        end = state.get(ENDED) or ("max_turns" if messages[-1]["role"] == "assistant" else "context")
        try:
            episode = session.finish(messages, end)
        finally:
            state.pop(SESSION, None)
        trace = session.policy.trace if session.policy is not None else None
        where = f"env {self.name}: task {task.id}"
        if trace is None:
            raise EnvError(f"{where}: its Env ran no turn of the model")
        if not trace.ok or not episode.ok:
            errors = [e.message for e in [*trace.errors, *episode.errors]]
            raise EnvError(f"{where}: the verifiers episode failed: {'; '.join(errors)[:300]}")
        for name, value in trace.rewards.items():
            if value is not None and not 0.0 <= value.score <= 1.0:
                raise EnvError(f"{where}: reward {name} is {value.score!r}, outside [0, 1]")
        if not 0.0 <= trace.reward <= 1.0:
            weights = {name: r.weight for name, r in trace.rewards.items() if r is not None}
            raise EnvError(f"{where}: the weighted sum of its rewards is {trace.reward!r}, outside [0, 1] "
                           f"(weights {weights})")
        sampled = [i for i, node in enumerate(trace.nodes) if node.sampled]
        turns = rollout.turns or [[0, None]]  # scored without fleetrl's turns: one turn, its end unknown
        if len(sampled) != len(turns):
            raise EnvError(f"{where}: its trace holds {len(sampled)} model turns, fleetrl's episode {len(turns)}")
        per_turn = []
        for node, (start, stop) in zip(sampled, turns):
            spans = _spans_within(rollout.spans, start, stop)
            versions = [span["version"] for span in spans]
            per_turn.append({"node": node, "tokens": [start, stop], "version_spans": spans,
                             "policy": vf.PolicySpan(start=min(versions), end=max(versions)).model_dump()})
        trace.info["fleetrl"] = {
            "step": rollout.step,
            "version_spans": [{"version": s.version, "start": s.start} for s in rollout.spans],
            "turns": per_turn,
        }
        episode.env = vf.EnvInfo(id=self.taskset.config.id, name=self.name)
        versions = [span.version for span in rollout.spans]
        policy = vf.PolicySpan(start=min(versions), end=max(versions))
        episode.record_run(vf.TrainRunInfo(id=self.run_id, name=self.run_name,
                                           work=vf.TrainWorkInfo(step=rollout.step, policy=policy)))
        return episode


def _trainable(episode) -> Any:
    """The trace of the seat fleetrl trains (a single-turn episode's only trace)."""
    return next((t for t in episode.traces if t.agent.trainable and "fleetrl" in t.info), episode.traces[0])


def _spans_within(spans, start: int, stop: int | None) -> list[dict[str, int]]:
    """The version spans over the tokens [start, stop), the first starting at `start`."""
    within = []
    for i, span in enumerate(spans):
        span_end = spans[i + 1].start if i + 1 < len(spans) else None
        if (stop is None or span.start < stop) and (span_end is None or span_end > start):
            within.append({"version": span.version, "start": max(span.start, start)})
    return within


def _prompt_messages(vf, data) -> list:
    """The conversation a harness would open with: the system prompt, then the prompt."""
    messages = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        messages.extend(data.prompt)
    return messages


def _needs_runtime(fn) -> bool:
    # verifiers' own rule: a reward with a required `runtime` parameter is skipped offline.
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty

