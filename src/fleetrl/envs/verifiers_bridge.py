"""A verifiers v1 `Env` driven turn by turn by fleetrl (the multi-turn half of the adapter).
verifiers' own control flow (`Env.setup`, `Env.run`, `Env.finalize`, the env's
`agents.<seat>.interaction(task)` / `turn()` and `agents.<seat>.run(task)`) runs unchanged on the
adapter's private event loop; the seat it talks to is a `_Seat`, not a `vf.Agent`: each time the
env asks it for a turn, it hands the turn's input messages to fleetrl and waits for what fleetrl
sampled. fleetrl's side (`Session.open/respond/finish/cancel`) is blocking and thread-safe:
fleetrl calls environments from daemon threads, never from the private loop. What the bridge
supports and records: docs/environments.md, "`verifiers` tasksets"."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fleetrl.envs.base import EnvError
from fleetrl.envs.tools import TOOL_CALL, Tool
from fleetrl.errors import one_line

if TYPE_CHECKING:
    import verifiers.v1 as vf

OPEN_TIMEOUT_S = 300.0  # the env's own work up to the model's first turn (setup included)


def to_fleet(message) -> dict[str, str]:
    from verifiers.v1.types import content_text

    return {"role": message.role, "content": content_text(message.content) or ""}


def to_typed(vf, new: list[dict[str, str]], call_ids: list[str]) -> list:
    """fleetrl messages after a model turn -> typed verifiers messages. An assistant turn's Hermes
    `<tool_call>` blocks become `ToolCall`s (its content: the text around them); the `tool`
    messages that follow answer those calls in order. `call_ids`: the trace's running ids."""
    from verifiers.v1.dialects import parse_message

    typed, pending = [], []
    for m in new:
        if m["role"] == "assistant":
            calls = []
            for body in TOOL_CALL.findall(m["content"]):
                try:
                    call = json.loads(body)
                    name, arguments = str(call.get("name")), json.dumps(call.get("arguments", {}))
                except (json.JSONDecodeError, AttributeError):
                    name, arguments = "", body.strip()
                call_ids.append(f"call_{len(call_ids)}")
                calls.append(vf.ToolCall(id=call_ids[-1], name=name, arguments=arguments))
            text = TOOL_CALL.sub("", m["content"]).strip() if calls else m["content"]
            typed.append(vf.AssistantMessage(content=text or None, tool_calls=calls or None))
            pending = list(calls)
        elif m["role"] == "tool":
            call = pending.pop(0) if pending else None
            typed.append(vf.ToolMessage(tool_call_id=call.id if call else "unmatched",
                                        name=call.name if call else None, content=m["content"]))
        else:
            typed.append(parse_message(m))
    return typed


class _Seat:
    """What `Env.run` sees as `agents.<name>` (duck-typing `vf.Agent`: run, interaction, trainable)."""

    def __init__(self, session: Session, name: str, spec) -> None:
        from verifiers.v1.session import RolloutLimits

        self.session, self.name, self.config = session, name, spec
        self.trainable = True  # Env.setup() may set it False
        self.limits = RolloutLimits(max_turns=spec.max_turns, max_input_tokens=spec.max_input_tokens,
                                    max_output_tokens=spec.max_output_tokens, max_total_tokens=spec.max_total_tokens)

    @asynccontextmanager
    async def interaction(self, task, **_: Any):
        conversation = self.session.conversation(self, task)
        try:
            yield conversation
        except Exception as e:
            conversation.trace.record_error(e)
            raise
        finally:
            await conversation.close("user_closed")

    async def run(self, task, **_: Any):
        """One segment on a prompted task: the model answers its prompt (tool calls included)."""
        conversation = self.session.conversation(self, task)
        try:
            await conversation.turn()
        except Exception as e:
            conversation.trace.record_error(e)
        return await conversation.close("agent_completed")


class _Conversation:
    """The trainable seat's rollout: its `vf.Trace`, built as verifiers' `Rollout` builds it."""

    def __init__(self, session: Session, seat: _Seat, task) -> None:
        from verifiers.v1.session import hook_boundary
        from verifiers.v1.state import state_cls

        vf = session.vf
        self.session, self.seat, self.task = session, seat, task
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=vf.AgentInfo(config=seat.config, name=seat.name, trainable=seat.trainable),
        )
        self.stops = [fn for fn in task.hooks("stop") if hook_boundary(fn, allow_trace=True) is vf.Trace]
        self.call_ids: list[str] = []
        self.started = self.over = self.closed = False

    async def _refused(self) -> str | None:
        """verifiers' check before each model call: a stop already set, a limit, a `@vf.stop`."""
        from verifiers.v1.session import call_hook

        if self.trace.stop_condition is not None:
            return self.trace.stop_condition
        if (limit := self.seat.limits.reached(self.trace)) is not None:
            self.trace.stop(limit)
            return limit
        for stop in self.stops:
            if await call_hook(stop, {self.session.vf.Trace: self.trace}):
                self.trace.stop(stop.__name__)
                return stop.__name__
        return None

    def _add(self, messages: list, sampled: bool) -> None:
        for m in messages:
            parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
            self.trace.nodes.append(self.session.vf.MessageNode(parent=parent, message=m,
                                                                sampled=sampled and m.role == "assistant"))

    async def turn(self, message=None):
        """`Interaction.turn`: one model answer (its tool calls and their results included)."""
        from verifiers.v1.agent import Segment
        from verifiers.v1.dialects import parse_message

        vf = self.session.vf
        if self.closed:
            raise RuntimeError("this interaction is closed")
        if self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self.started and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        if await self._refused():
            self.over = True
            return Segment(messages=[], terminated=True)
        inputs = []
        if not self.started:
            if self.task.data.system_prompt:
                inputs.append(vf.SystemMessage(content=self.task.data.system_prompt))
            if prompted:
                prompt = self.task.data.prompt
                inputs += [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt)
        if isinstance(message, str):
            inputs.append(vf.UserMessage(content=message))
        elif message is not None:
            inputs += [parse_message(m) if isinstance(m, dict) else m for m in message]
        self.started = True
        self._add(inputs, sampled=False)
        produced = await self.session.policy_turn(self, inputs)
        if not produced:
            self.over = True
            return Segment(messages=[], terminated=True)
        self._add(produced, sampled=True)
        return Segment(messages=produced)

    async def close(self, condition: str):
        """Stop, score with the task's rewards (not when the episode was abandoned), join the episode."""
        if self.closed:
            return self.trace
        self.closed = True
        if self.trace.stop_condition is None and not self.trace.errors:
            self.trace.stop(condition)
        ok = not self.trace.errors
        if ok and not self.session.abandoned:
            try:
                await self.task.score(self.trace)
            except Exception as e:
                self.trace.record_error(e)
                ok = False
        self.trace.is_completed, self.trace.ok = True, ok
        self.session.episode.traces.append(self.trace)
        return self.trace


class Session:
    """One episode of a verifiers env, run on `loop`, with fleetrl sampling its trainable seat."""

    def __init__(self, vf, name: str, env, vf_task, loop: asyncio.AbstractEventLoop, task_id: str) -> None:
        self.vf, self.name, self.env, self.task, self.loop, self.task_id = vf, name, env, vf_task, loop, task_id
        self.episode = vf.Episode(env=vf.EnvInfo(id=env.config.env_id, name=name),
                                  task=vf.TraceTask(type=type(vf_task).__name__, data=vf_task.data,
                                                    key=vf_task.key, hash=vf_task.hash))
        self.policy: _Conversation | None = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.synced = 0  # how many of fleetrl's messages the env has seen
        self.finished = threading.Event()  # Env.run (and finalize) returned, raised or was cancelled
        self._to_fleet: asyncio.Queue | None = None
        self._from_fleet: asyncio.Queue | None = None
        self._main: asyncio.Task | None = None

    def conversation(self, seat: _Seat, task) -> _Conversation:
        return _Conversation(self, seat, task)

    # --- the loop's side ------------------------------------------------------------------------
    async def _run(self) -> None:
        from verifiers.v1.configs.agent import agent_config_fields

        vf, env = self.vf, self.env
        agents = vf.Agents(env.config, make=lambda name, spec: _Seat(self, name, spec))
        try:
            await env.setup(agents)
            seats = [getattr(agents, name) for name in agent_config_fields(env.config)]
            if not all(seat.trainable for seat in seats):
                raise EnvError(f"env {self.name}: its setup() makes seat(s) "
                               f"{[s.name for s in seats if not s.trainable]} frozen, which needs a model "
                               "fleetrl does not provide")
            await env.run(self.task, agents)
            if not self.episode.traces:
                raise EnvError(f"env {self.name}: {type(env).__name__}.run() ran no agent on task {self.task_id}")
            if not self.abandoned:
                await env.finalize(self.task, self.episode)
            self.episode.ok = all(t.ok for t in self.episode.traces)
        except asyncio.CancelledError:
            self.abandoned = True
            raise
        except Exception as e:
            self.error = e
            self.episode.errors.append(vf.Error(type=type(e).__name__, message=str(e)))
        finally:
            self.finished.set()
            self._to_fleet.put_nowait(("done", None))

    async def policy_turn(self, conversation: _Conversation, inputs: list) -> list | None:
        if self.policy is None:
            self.policy = conversation
        elif conversation is not self.policy:
            raise EnvError(f"env {self.name}: its run() opened a second conversation with the model, "
                           "which fleetrl's one-conversation episodes do not provide")
        self._to_fleet.put_nowait(("messages", [to_fleet(m) for m in inputs]))
        new, reason = await self._from_fleet.get()
        typed = to_typed(self.vf, new, conversation.call_ids)
        if reason is not None:  # fleetrl ended the episode (max_turns, context): no next turn
            conversation.trace.stop(reason)
        return typed or None

    async def _start(self) -> None:
        self._to_fleet, self._from_fleet = asyncio.Queue(), asyncio.Queue()
        self._main = asyncio.create_task(self._run())

    # --- fleetrl's side (blocking; from any thread but the loop's) -------------------------------
    def _next(self, timeout: float | None) -> list[dict[str, str]] | None:
        kind, payload = asyncio.run_coroutine_threadsafe(self._to_fleet.get(), self.loop).result(timeout)
        if kind == "done":
            if self.error is not None:
                if isinstance(self.error, EnvError):
                    raise self.error
                raise EnvError(f"env {self.name}: on task {self.task_id}, {type(self.env).__name__} raised "
                               f"{one_line(self.error)}")
            return None
        return payload

    def open(self, timeout: float | None = OPEN_TIMEOUT_S) -> list[dict[str, str]]:
        """Run the env up to the model's first turn; the messages that turn sees."""
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout)
        first = self._next(timeout)
        if first is None:
            raise EnvError(f"env {self.name}: task {self.task_id} ended before the model's first turn")
        self.synced = len(first)
        return first

    def respond(self, messages: list[dict[str, str]], timeout: float | None = None) -> list[dict[str, str]] | None:
        """The env's answer to the model's turn: `messages` is the whole conversation so far."""
        if self.finished.is_set():
            return None
        self.loop.call_soon_threadsafe(self._from_fleet.put_nowait, (messages[self.synced:], None))
        reply = self._next(timeout)
        self.synced = len(messages) + len(reply or [])
        return reply

    def finish(self, messages: list[dict[str, str]], reason: str, timeout: float | None = None):
        """fleetrl's episode is over: hand the env what it has not seen, let `Env.run` wind down
        (any further turn it asks for is refused), and return the finalized `vf.Episode`."""
        new = messages[self.synced:]
        while not self.finished.is_set():
            self.loop.call_soon_threadsafe(self._from_fleet.put_nowait, (new, reason))
            new = []
            self._next(timeout)
        self.synced = len(messages)
        return self.episode

    def cancel(self, timeout: float | None = 30.0) -> None:
        """Abandon the episode: cancel `Env.run` (nothing is scored) and wait until it is gone."""
        if self._main is None or self.finished.is_set():
            return
        self.abandoned = True
        self.loop.call_soon_threadsafe(self._main.cancel)
        self.finished.wait(timeout)


def check_toolsets(name: str, toolsets: list) -> None:
    """Refuse toolsets that need the rollout's identity in each call (per-rollout state, per-task setup)."""
    from verifiers.v1.mcp.server import ServerBase
    from verifiers.v1.state import State, state_cls

    for toolset in toolsets:
        if state_cls(type(toolset)) is not State:
            raise EnvError(f"env {name}: toolset {type(toolset).__name__} keeps per-rollout state, which fleetrl's "
                           "in-process tools do not provide")
        if type(toolset).setup_task is not ServerBase.setup_task:
            raise EnvError(f"env {name}: toolset {type(toolset).__name__} has a per-task setup_task, which fleetrl's "
                           "in-process tools do not provide")


async def load_tools(name: str, toolsets: list, loop: asyncio.AbstractEventLoop, timeout_s: float) -> list[Tool]:
    """Every tool of `toolsets`, served in process (on `loop`) by verifiers' own registration."""
    from mcp.server.mcpserver import MCPServer

    tools = []
    for toolset in toolsets:
        await toolset.setup()
        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        prefix = toolset.server_name  # how verifiers' chat harness qualifies the tool's name
        for tool in await server.list_tools():
            full = f"{prefix}_{tool.name}" if prefix else tool.name
            tools.append(Tool(name=full, fn=_tool_fn(name, server, tool.name, full, tool.input_schema, loop, timeout_s),
                              description=tool.description or "", parameters=tool.input_schema, timeout_s=timeout_s))
    return tools


def _tool_fn(env_name: str, server, raw_name: str, full: str, schema: dict, loop, timeout_s: float) -> Callable:
    """A plain sync callable for fleetrl: the model's bad arguments come back as text; a tool that
    raises raises (fleetrl then ends the episode, `tool_failed`)."""
    from mcp.server.mcpserver.exceptions import ToolError
    from pydantic import ValidationError
    from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content

    async def call(arguments: dict) -> str:
        try:
            result = await server.call_tool(raw_name, arguments)
        except ToolError as e:
            if isinstance(e.__cause__, ValidationError) and e.__cause__.title == f"{raw_name}Arguments":
                return f"error: {e}"  # the model's arguments do not fit the tool: its mistake to learn from
            cause = e.__cause__ or e
            raise RuntimeError(f"{type(cause).__name__}: {cause}") from cause
        content = mcp_content_to_chat_content(result.content)  # verifiers' harness conversion
        return content if isinstance(content, str) else json.dumps(content)

    def fn(**arguments) -> str:
        future = asyncio.run_coroutine_threadsafe(call(arguments), loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    # fleetrl checks a call's arguments against the callable's signature (envs/tools.py): give it the tool's.
    required = set(schema.get("required", []))
    fn.__signature__ = inspect.Signature([
        inspect.Parameter(param, inspect.Parameter.KEYWORD_ONLY,
                          **({} if param in required else {"default": None}))
        for param in sorted(schema.get("properties", {}), key=lambda p: p not in required)
    ])
    fn.__name__ = full
    return fn
