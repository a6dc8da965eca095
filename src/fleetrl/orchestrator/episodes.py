"""Multi-turn episodes: the model and the environment take turns, token-exact, versions per turn.
One episode is one sample: each model turn as the engine sampled it, with its own version span,
and between turns the environment's tokens (`ChatTokens`), masked out of the loss. Off-policy
control holds per episode (stopped above k, or with `orchestrator.partial_episodes` continued,
its tokens past k kept as context). How an episode ends and what fleetrl keeps exact:
docs/environments.md, "A multi-turn environment", "What fleetrl keeps exact" and "What the run
records"."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleetrl.envs import EnvError, MultiTurnEnvironment, Task, env_tools, respond
from fleetrl.envs.tools import Tool, ToolCall, parse_tool_calls
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import GenerateRequest, GenerateResponse, SamplingParams
from fleetrl.orchestrator.chat import ChatTokens
from fleetrl.orchestrator.threads import call_user_code
from fleetrl.versions import VersionSpan, off_policy_distance, span_ends

# How an episode ended; the faults among them drop it (they are its sample's drop_reason).
FAULTS = ("tool_failed", "env_failed", "misversioned", "bad_answer", "off_policy")


@dataclass
class Episode:
    task: Task
    prompt_ids: list[int]
    messages: list[dict[str, str]]  # the conversation so far, the task's messages first
    state: dict[str, Any]  # the environment's, across the turns (`respond`)
    token_ids: list[int] = field(default_factory=list)  # after the prompt: model and environment tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's on model tokens, 0 on the others
    loss_mask: list[int] = field(default_factory=list)  # 1 on model tokens
    spans: list[VersionSpan] = field(default_factory=list)  # each model turn opens one
    turns: list[list[int]] = field(default_factory=list)  # [start, end) of each model turn
    workers: list[str] = field(default_factory=list)  # that served its turns
    prefill_workers: list[str] = field(default_factory=list)  # that computed their prompts' KV (disaggregated)
    end: str = ""  # why it ended (see the module's docstring)
    error: str | None = None  # the fault that ended it, in one line naming what failed

    def add_model_turn(self, completion: GenerateResponse) -> None:
        start = len(self.token_ids)
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.loss_mask += [1] * len(completion.token_ids)
        self.spans += [VersionSpan(s.version, s.start + start) for s in completion.spans]
        self.turns.append([start, len(self.token_ids)])
        if completion.worker_id not in self.workers:
            self.workers.append(completion.worker_id)
        if completion.prefill_worker_id and completion.prefill_worker_id not in self.prefill_workers:
            self.prefill_workers.append(completion.prefill_worker_id)

    def add_environment_tokens(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)

    def train_only_from(self, version: int) -> None:
        """Mask out of the loss the model tokens older than `version` (partial episodes)."""
        for span, end in span_ends(self.spans, len(self.token_ids)):
            if span.version < version:
                self.loss_mask[span.start:end] = [0] * (end - span.start)

    def response(self) -> GenerateResponse:
        """The episode as one completion, the form the orchestrator records and trains on."""
        return GenerateResponse(
            request_id=self.task.id, token_ids=self.token_ids, logprobs=self.logprobs, finish_reason=self.end,
            worker_id="+".join(self.workers), spans=self.spans,
            version_error=self.error if self.end == "misversioned" else None,
            answer_error=self.error if self.end == "bad_answer" else None,
            prefill_worker_id="+".join(self.prefill_workers) or None,
        )


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_context: int  # the engine's max_model_len: prompt + completion of every turn
    max_off_policy_steps: int
    partial_episodes: bool
    user_code_timeout_s: float  # an environment's answer to one turn


async def run_episode(fleet: Fleet, env: MultiTurnEnvironment, chat: ChatTokens, decode: Callable[[list[int]], str],
                      task: Task, prompt_ids: list[int], sampling: SamplingParams, session_id: str, step: int,
                      name: str, limits: EpisodeLimits) -> Episode:
    """Model turns and environment answers until the episode (`name`, unique in the run) ends;
    never raises for a fault of the environment, a tool or a worker's version: those end the
    episode (`end`, `error`)."""
    episode = Episode(task=task, prompt_ids=prompt_ids, messages=list(task.messages),
                      state={"episode": name, "step": step})
    await _take_turns(episode, fleet, env, chat, decode, sampling, session_id, step, limits)
    if callable(getattr(env, "episode_ended", None)):
        try:
            await call_user_code(f"env {env.name}: episode_ended of task {task.id}", limits.user_code_timeout_s,
                                 "orchestrator.reward_timeout_s", env.episode_ended, task, episode.state, episode.end)
        except EnvError as e:  # a fault already ending the episode is the one to report
            if episode.end not in FAULTS:
                episode.end, episode.error = "env_failed", str(e)
    return episode


def turn_min_version(episode: Episode, step: int, limits: EpisodeLimits) -> int | None:
    """The oldest version the next turn may be sampled at: never older than a turn before it (in
    a rolling publish the fleet serves two versions, and a turn moved off a lost worker could
    land on one still at the version before), nor, unless partial episodes may go past k,
    further than k behind the policy being trained."""
    floors = [s.version for s in episode.spans]
    if not limits.partial_episodes:
        floors.append((step - 1) - limits.max_off_policy_steps)
    return max(floors, default=None)


async def _take_turns(episode: Episode, fleet: Fleet, env: MultiTurnEnvironment, chat: ChatTokens,
                      decode: Callable[[list[int]], str], sampling: SamplingParams, session_id: str, step: int,
                      limits: EpisodeLimits) -> None:
    task, prompt_ids = episode.task, episode.prompt_ids
    tools = {tool.name: tool for tool in env_tools(env)}
    for turn in range(1, limits.max_turns + 1):
        context = prompt_ids + episode.token_ids
        if len(context) + sampling.max_tokens > limits.max_context:
            episode.end = "context"
            break
        (completion,) = await fleet.generate(GenerateRequest(prompt_token_ids=context, sampling=sampling, n=1,
                                                             session_id=session_id,
                                                             min_version=turn_min_version(episode, step, limits)))
        if completion.answer_error:  # no tokens to add: the episode ends on the turn before
            episode.end, episode.error = "bad_answer", completion.answer_error
            break
        episode.add_model_turn(completion)
        if completion.version_error:
            episode.end, episode.error = "misversioned", completion.version_error
            break
        episode.messages.append({"role": "assistant", "content": decode(completion.token_ids)})
        if turn == limits.max_turns:
            episode.end = "max_turns"
            break
        # While it is sampled, an episode trains every model token, and its spans open only on them.
        if not limits.partial_episodes and off_policy_distance(step, episode.spans) > limits.max_off_policy_steps:
            episode.end = "off_policy"  # no use sampling more of what will not be trained
            break
        try:
            reply = await _answer(env, tools, task, episode.messages, episode.state, limits.user_code_timeout_s)
        except _EpisodeFault as fault:
            episode.end, episode.error = fault.reason, str(fault)
            break
        if reply is None:
            episode.end = "done"
            break
        episode.messages += reply
        episode.add_environment_tokens(chat.between_turns(completion.token_ids, reply))


class _EpisodeFault(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


async def _answer(env: MultiTurnEnvironment, tools: dict[str, Tool], task: Task, messages: list[dict[str, str]],
                  state: dict[str, Any], timeout_s: float) -> list[dict[str, str]] | None:
    """What follows the model's last turn: its tool calls' results, or the environment's answer."""
    if calls := parse_tool_calls(messages[-1]["content"], tools) if tools else []:
        return [{"role": "tool", "content": await _call(tools, call, env.name, task.id)} for call in calls]
    try:
        return await call_user_code(f"env {env.name}: its answer to a turn of task {task.id}", timeout_s,
                                    "orchestrator.reward_timeout_s", respond, env, task, messages, state)
    except EnvError as e:
        raise _EpisodeFault("env_failed", str(e)) from None


async def _call(tools: dict[str, Tool], call: ToolCall, env_name: str, task_id: str) -> str:
    """The text a tool call answers with; a call the model wrote badly answers with its mistake."""
    if call.error:
        return f"error: {call.error}"
    tool = tools[call.name]
    try:
        result = await call_user_code(f"env {env_name}: tool {tool.name} on task {task_id}", tool.timeout_s,
                                      "its timeout_s", functools.partial(tool.fn, **call.arguments))
    except EnvError as e:
        raise _EpisodeFault("tool_failed", str(e)) from None
    return str(result)
