"""Run a `verifiers` (v1 API) taskset as a fleetrl environment, and record what produced each rollout.

`verifiers:<taskset id>` loads the taskset package the way verifiers does (`load_taskset`:
the id names an installed module exporting one `Taskset` subclass). fleetrl plays the agent
itself, single-turn: the prompt is the task's `system_prompt` + `prompt`, fleetrl's inference
fleet samples the completion, and the task's own `@vf.reward` functions score it on a
verifiers `Trace` holding those messages. The reward is the trace's weighted sum of rewards.

Every scored rollout becomes a verifiers `Episode` whose run is stamped the way verifiers'
own trainers stamp it: `TrainRunInfo(id, name, work=TrainWorkInfo(step, policy=PolicySpan(
start, end)))`, with `start`/`end` the oldest and newest policy version that produced the
completion. The exact per-token version spans go to `trace.info["fleetrl"]`. With
`episodes_path` set, each episode is appended there as one JSON line (`Episode.to_record()`),
readable with `verifiers.v1.WireEpisode.model_validate`, and synced to disk as it is written (a
resumed `fleetrl rl` drops the episodes of the steps it redoes, by their run stamp's step).

Not supported, and refused with a clear error: tasks that need a container or tool servers,
prompt-less tasks (the user opens the conversation), and rewards that need a runtime; they
need a verifiers harness driving a sandbox, which is not what a single-turn RL loop is.

`verifiers` is optional: it is imported only when such an environment is built.
"""

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

from fleetrl.envs.base import EnvError, Rollout, Task, one_line
from fleetrl.files import append_line

if TYPE_CHECKING:
    import verifiers.v1 as vf

UNSUPPORTED = "fleetrl's single-turn adapter does not provide"


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
        if self.taskset.toolsets(self.taskset.config) or task_cls.toolsets(self.taskset.config.task):
            raise EnvError(f"env {self.name}: its tasks use tool servers, which {UNSUPPORTED}")
        self.episodes_path = Path(episodes_path) if episodes_path is not None else None
        self.run_id = run_id
        self.run_name = run_name
        # verifiers scores asynchronously; the orchestrator may call `reward` from inside its
        # own event loop, where `asyncio.run` is refused. One private loop thread serves both.
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name=f"{self.name} scoring", daemon=True).start()
        self._write_lock = threading.Lock()  # rewards are scored in threads: one line at a time

    def tasks(self, seed: int) -> Iterator[Task]:
        """A finite taskset is reshuffled every pass (seeded); an infinite one is its own
        stream, which verifiers does not seed: every seed then yields the same tasks."""
        if not self.taskset.bounded:
            for vf_task in self.taskset:
                yield self._task(vf_task)
            return
        tasks = [self._task(vf_task) for vf_task in self.taskset]
        if not tasks:
            raise EnvError(f"env {self.name}: the taskset has no tasks")
        rng = random.Random(seed)
        while True:
            yield from rng.sample(tasks, len(tasks))

    def reward(self, rollout: Rollout) -> float:
        episode = self.episode(rollout)
        if self.episodes_path is not None:
            line = json.dumps(episode.to_record())
            with self._write_lock:
                append_line(self.episodes_path, line)
        return episode.traces[0].reward

    def episode(self, rollout: Rollout) -> vf.Episode:
        """The scored verifiers `Episode` of one rollout, stamped with its policy provenance."""
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

