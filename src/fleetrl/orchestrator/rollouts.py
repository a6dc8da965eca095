"""The orchestrator: samples groups from the fleet, scores them, assembles batch `n` for step `n`.
Rollouts for batch n are admitted only once the fleet serves version >= (n - 1) - k
(k = `max_off_policy_steps`); at assembly each sample's distance is recomputed from its own spans,
and a sample past k, misversioned, empty, badly answered, whose reward failed or (multi-turn)
whose tool or environment failed is dropped, counted and recorded with its `drop_reason`, never
trained on. Rewards run in threads of their own, off the event loop that drives the fleet. Dynamic
sampling, the task window of each step and each batch's meta: docs/architecture.md, "The RL run";
docs/config.md (`[orchestrator]`); the figures: docs/quickstart.md, section 3."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass

from fleetrl import failpoints
from fleetrl.batch import Batch, Sample
from fleetrl.config import OrchestratorConfig
from fleetrl.envs import EnvError, Rollout, env_tools, is_multi_turn, score
from fleetrl.envs.mix import Drawn, RunEnv, run_task_stream
from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet import Fleet
from fleetrl.inference.types import GenerateRequest, GenerateResponse, SamplingParams
from fleetrl.orchestrator.advantages import group_advantages
from fleetrl.orchestrator.chat import ChatTokens, render_prompt
from fleetrl.orchestrator.episodes import FAULTS, Episode, EpisodeLimits, run_episode
from fleetrl.orchestrator.threads import call_user_code
from fleetrl.records import BatchMeta, EnvFigures, Figures, RolloutRecord, SampleEvent, WorkerFigures
from fleetrl.rundir import RunDir
from fleetrl.versions import VersionSpan, off_policy_distance, trained_spans


# Rewards scored at once, at most: a thread each, whose slot is given back when the reward
# returns or times out. Enough that slow rewards do not hold up the others; more would not
# score faster (rewards are mostly Python, holding the GIL).
REWARD_THREADS = 32


@dataclass
class Scored:
    drawn: Drawn  # the task, its environment and the run's id of it
    prompt_ids: list[int]
    completion: GenerateResponse
    text: str
    reward: float | None  # None: not scored (an empty completion), or its reward failed
    reward_error: str | None = None  # why the reward failed, naming the env and the task
    episode: Episode | None = None  # a multi-turn environment's: `completion` is the whole episode

    def trained_spans(self) -> list[VersionSpan]:
        return trained_spans(self.completion.spans, self.episode.loss_mask if self.episode else None)


class Orchestrator:
    def __init__(self, fleet: Fleet, envs: list[RunEnv], tokenizer, config: OrchestratorConfig,
                 run_dir: RunDir, seed: int, max_context: int, log=print) -> None:
        """`envs`: the run's environments (envs/mix.py); `max_context`: the engine's
        max_model_len, which a multi-turn episode's turns must fit in."""
        self.fleet = fleet
        self.envs = envs
        self.tokenizer = tokenizer
        self.config = config
        self.run_dir = run_dir
        self.log = log
        self.seed = seed
        self._tasks = run_task_stream(envs, seed)
        self._drawn = 0  # tasks taken from the stream so far (used or sought past)
        self._reward_slots = asyncio.Semaphore(REWARD_THREADS)
        self.progress: tuple[int, int] | None = None  # (the step being sampled, its completions so far)
        self.sampling = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            max_tokens=config.max_tokens,
            stop_token_ids=(tokenizer.eos_token_id,),
        )
        # Per environment, by name: whether its tasks are episodes, and the tools its prompts offer.
        self.multi_turn = {e.name: is_multi_turn(e.env) for e in envs}
        self.tool_schemas = {e.name: [tool.schema() for tool in env_tools(e.env)] for e in envs}
        self.chat = ChatTokens(tokenizer) if any(self.multi_turn.values()) else None
        self.limits = EpisodeLimits(max_turns=config.max_turns, max_context=max_context,
                                    max_off_policy_steps=config.max_off_policy_steps,
                                    partial_episodes=config.partial_episodes,
                                    user_code_timeout_s=config.reward_timeout_s)

    async def run(self, first_step: int, last_step: int) -> None:
        """Write batches first_step..last_step, each as soon as admission allows."""
        for step in range(first_step, last_step + 1):
            self.run_dir.write_batch(await self.make_batch(step))

    async def make_batch(self, step: int) -> Batch:
        k = self.config.max_off_policy_steps
        admitted = (step - 1) - k
        await self.fleet.wait_for_version(admitted)
        started = time.time()
        self.progress = (step, 0)
        dispatch_version = self.fleet.version
        window = await self._tasks_of(step)
        groups = await self._sample_groups(step, window)
        await failpoints.held("rollout", step)
        finished = time.time()
        filtered = self._filtered(step, groups)

        samples, records = [], []
        drops = Counter()  # samples not trained on, by drop_reason
        for group_index, group in enumerate(groups):
            usable = []
            for scored in group:
                if reason := self.unusable(scored) or ("filtered" if group_index in filtered else None):
                    drops[reason] += 1
                    records.append(self.record(step, group_index, scored, None, reason))
                else:
                    usable.append(scored)
            if not usable:
                continue
            advantages = group_advantages([s.reward for s in usable], self.config.normalize_advantages_std)
            for scored, advantage in zip(usable, advantages):
                c = scored.completion
                if scored.episode and self.config.partial_episodes:
                    scored.episode.train_only_from((step - 1) - k)  # its older tokens become context
                spans = scored.trained_spans()
                if not spans or off_policy_distance(step, spans) > k:
                    drops["off_policy"] += 1
                    records.append(self.record(step, group_index, scored, advantage, "off_policy"))
                    continue
                samples.append(Sample(
                    prompt_ids=scored.prompt_ids,
                    completion_ids=c.token_ids,
                    inference_logprobs=c.logprobs,
                    spans=c.spans,
                    reward=scored.reward,
                    advantage=advantage,
                    group=group_index,
                    loss_mask=scored.episode.loss_mask if scored.episode else None,
                    turns=scored.episode.turns if scored.episode else None,
                    worker=c.worker_id,
                    env=scored.drawn.env.name,
                ))
                records.append(self.record(step, group_index, scored, advantage, None))
        self.run_dir.write_rollouts(step, records)
        reward_errors = [r.reward_error for r in records if r.drop_reason == "reward_failed"]
        self._log_drops(step, drops, reward_errors, records)
        if not samples:
            raise FleetrlError(
                f"batch {step} is empty: of {len(records)} samples {drops['off_policy']} exceeded "
                f"orchestrator.max_off_policy_steps = {k}, {drops['misversioned']} were misversioned, "
                f"{drops['reward_failed']} had a failed reward and {drops['empty']} were empty"
                + "".join(f", {drops[why]} {why}" for why in (*FAULTS, "filtered") if drops[why] and why != "off_policy")
                + (f" (the first failed reward: {reward_errors[0]})" if reward_errors else ""))
        rewards = [r.reward for r in records if r.reward is not None]
        distances = [off_policy_distance(step, s.trained_spans()) for s in samples]
        mean = sum(rewards) / len(rewards)
        meta = BatchMeta(
            sampled_prompts=len(groups),
            filtered=len(filtered),
            generated=batch_figures(records),
            trained=batch_figures([r for r in records if r.trained]),
            dropped_by=dict(sorted(drops.items())),
            envs=env_figures(records),
            workers=worker_figures(records, finished - started),
            rollout_started=started,
            rollout_finished=finished,
            dispatch_version=dispatch_version,
            reward_mean=mean,
            reward_std=math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
            distance_max=max(distances),
            distance_mean=sum(distances) / len(distances),
        )
        return Batch(step=step, samples=samples, meta=meta)

    async def _sample_groups(self, step: int, window: list[Drawn]) -> list[list[Scored]]:
        """The groups of batch `step`: its first batch_prompts tasks, and with dynamic sampling,
        more of `window`, as many as groups are missing, until none is or the window is used."""
        wanted = self.config.batch_prompts

        async def sample(first: int, tasks: list[Drawn]) -> list[list[Scored]]:
            return list(await asyncio.gather(*(self._sample_group(step, first + i, task)
                                               for i, task in enumerate(tasks))))

        groups = await sample(0, window[:wanted])
        while self.config.dynamic_sampling and len(groups) < len(window):
            missing = wanted - sum(1 for group in groups if carries_gradient(self._usable(group)))
            if missing <= 0:
                break
            groups += await sample(len(groups), window[len(groups):len(groups) + missing])
        return groups

    def _filtered(self, step: int, groups: list[list[Scored]]) -> set[int]:
        """The groups dynamic sampling drops: those without a gradient; none if that is all of them."""
        if not self.config.dynamic_sampling:
            return set()
        # Groups with usable samples only: one with none drops its samples for their own reasons.
        flat = {i for i, group in enumerate(groups)
                if (usable := self._usable(group)) and not carries_gradient(usable)}
        if flat and len(flat) == sum(1 for group in groups if self._usable(group)):
            self.log(f"fleetrl: batch {step}: the rewards of every group were equal within each, over "
                     f"{len(groups)} prompts (orchestrator.dynamic_sampling_prompts): trained as sampled, "
                     "with no gradient but the KL penalty's")
            return set()
        return flat

    def _usable(self, group: list[Scored]) -> list[Scored]:
        return [scored for scored in group if not self.unusable(scored)]

    def _log_drops(self, step: int, drops: Counter, reward_errors: list[str], records: list[RolloutRecord]) -> None:
        """One line per kind of fault in the batch (off-policy drops are the step line's)."""
        if drops["misversioned"]:
            self.log(f"fleetrl: batch {step}: rejected {drops['misversioned']} sample(s) from a worker at the wrong version")
        if drops["reward_failed"]:
            self.log(f"fleetrl: batch {step}: dropped {drops['reward_failed']} sample(s) whose reward failed "
                     f"(the first: {reward_errors[0]})")
        if drops["empty"]:
            self.log(f"fleetrl: batch {step}: dropped {drops['empty']} empty completion(s)")
        if drops["bad_answer"]:
            first = next(r.answer_error for r in records if r.drop_reason == "bad_answer")
            self.log(f"fleetrl: batch {step}: dropped {drops['bad_answer']} sample(s) a worker answered badly "
                     f"(the first: {first})")
        for fault, what in (("tool_failed", "a tool"), ("env_failed", "the environment's answer")):
            if drops[fault]:
                first = next(r.episode_error for r in records if r.drop_reason == fault)
                self.log(f"fleetrl: batch {step}: dropped {drops[fault]} episode(s) ended by a failure of {what} "
                         f"(the first: {first})")

    async def _tasks_of(self, step: int) -> list[Drawn]:
        """Step `step`'s window of the stream: `prompts_per_step` tasks from (step - 1) times
        that, seeking past those of the steps before that this orchestrator did not make (a
        resumed run's: `run_task_stream`'s `start`, which generates none of them where the
        environments can seek). Steps come in order. Dynamic sampling may leave the end of a
        window unused. The stream is user code: drawn off the event loop, within
        orchestrator.task_timeout_s."""
        size = self.config.prompts_per_step()
        first = (step - 1) * size
        if first != self._drawn:
            self._tasks = run_task_stream(self.envs, self.seed, start=first)
        envs = ", ".join(e.name for e in self.envs)
        tasks = await call_user_code(f"env {envs}: drawing tasks {first}..{first + size - 1} (batch {step})",
                                     self.config.task_timeout_s, "orchestrator.task_timeout_s",
                                     lambda: list(itertools.islice(self._tasks, size)))
        self._drawn = first + len(tasks)
        if len(tasks) < self.config.batch_prompts:
            raise EnvError(f"env {envs}: its task stream ended after {self._drawn} tasks "
                           f"(batch {step} needs tasks {first}..{first + self.config.batch_prompts - 1})")
        return tasks

    async def prompt_ids(self, drawn: Drawn, tools: list[dict] | None = None) -> list[int]:
        """`drawn`'s prompt in the policy's chat template (with `tools`' schemas), rendered off
        the event loop within orchestrator.task_timeout_s: a template is code the loop that
        drives the fleet must not hang on."""
        return await call_user_code(f"env {drawn.env.name}: rendering the prompt of task {drawn.id}",
                                    self.config.task_timeout_s, "orchestrator.task_timeout_s",
                                    render_prompt, self.tokenizer, drawn.task.messages, tools)

    async def _sample_group(self, step: int, index: int, drawn: Drawn) -> list[Scored]:
        # One session per group: its samples share the prompt, so one worker's prefix cache
        # serves them all, and the turns of an episode stay on the worker that holds its context.
        session = f"step{step}-group{index}"
        if self.multi_turn[drawn.env.name]:
            prompt_ids = await self.prompt_ids(drawn, self.tool_schemas[drawn.env.name])
            return list(await asyncio.gather(*(self._sample_episode(step, index, i, drawn, prompt_ids, session)
                                               for i in range(self.config.group_size))))
        prompt_ids = await self.prompt_ids(drawn)
        request = GenerateRequest(prompt_token_ids=prompt_ids, sampling=self.sampling, n=self.config.group_size,
                                  session_id=session, min_version=(step - 1) - self.config.max_off_policy_steps)
        started = time.time()
        completions = await self.fleet.generate(request)
        finished = time.time()
        for i, c in enumerate(completions):
            self._sampled(step, index, i, c, started, finished)
        return list(await asyncio.gather(*(self.score_completion(step, drawn, prompt_ids, c) for c in completions)))

    async def _sample_episode(self, step: int, group: int, sample: int, drawn: Drawn, prompt_ids: list[int],
                              session: str) -> Scored:
        started = time.time()
        episode = await run_episode(self.fleet, drawn.env.env, self.chat, self.decode, drawn.task, prompt_ids,
                                    self.sampling, session, step, f"{session}-sample{sample}", self.limits)
        completion = episode.response()
        self._sampled(step, group, sample, completion, started, time.time())
        return await self.score_completion(step, drawn, prompt_ids, completion, episode)

    def _sampled(self, step: int, group: int, sample: int, completion: GenerateResponse, started: float,
                 finished: float) -> None:
        """Progress, and the timeline's event: one bar per sample, split at its spans."""
        if self.progress and self.progress[0] == step:  # with k > 0 an older step may still be finishing
            self.progress = (step, self.progress[1] + 1)
        self.run_dir.append_event(SampleEvent(step=step, group=group, sample=sample, worker=completion.worker_id,
                                              start=started, end=finished, tokens=len(completion.token_ids),
                                              spans=[[s.version, s.start] for s in completion.spans]))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def score_completion(self, step: int, drawn: Drawn, prompt_ids: list[int], completion: GenerateResponse,
                               episode: Episode | None = None) -> Scored:
        """The completion with its reward (or why it has none), for the batch of `step`."""
        text = self.decode(completion.token_ids)
        task, env = drawn.task, drawn.env.env
        scored = Scored(drawn=drawn, prompt_ids=prompt_ids, completion=completion, text=text, reward=None,
                        episode=episode)
        if not completion.token_ids or (episode and episode.end in FAULTS):  # dropped unscored
            return scored
        if episode:
            last = episode.messages[-1] if episode.messages[-1]["role"] == "assistant" else {"content": ""}
            rollout = Rollout(task=task, completion=last["content"], spans=completion.spans, step=step,
                              messages=episode.messages, state=episode.state, turns=episode.turns)
        else:
            rollout = Rollout(task=task, completion=text, spans=completion.spans, step=step,
                              messages=[*task.messages, {"role": "assistant", "content": text}])
        async with self._reward_slots:
            try:
                scored.reward = await call_user_code(f"env {env.name}: reward of task {task.id}",
                                                     self.config.reward_timeout_s, "orchestrator.reward_timeout_s",
                                                     score, env, rollout)
            except EnvError as e:
                scored.reward_error = str(e)
        return scored

    @staticmethod
    def unusable(scored: Scored) -> str | None:
        """Why a sample can neither be trained on nor stand in its group's baseline, if so."""
        if scored.episode and scored.episode.end in FAULTS:
            return scored.episode.end
        if scored.completion.answer_error:
            return "bad_answer"
        if scored.completion.version_error:
            return "misversioned"
        if not scored.completion.token_ids:
            return "empty"
        if scored.reward is None:
            return "reward_failed"
        return None

    @staticmethod
    def record(step: int, group: int, scored: Scored, advantage: float | None,
               drop_reason: str | None) -> RolloutRecord:
        c, episode, spans = scored.completion, scored.episode, scored.trained_spans()
        return RolloutRecord(
            step=step, group=group, task=scored.drawn.id, env=scored.drawn.env.name, completion=scored.text,
            reward=scored.reward, advantage=advantage, worker=c.worker_id, completion_tokens=len(c.token_ids),
            prefill_worker=c.prefill_worker_id, spans=[[s.version, s.start] for s in c.spans],
            distance=off_policy_distance(step, spans) if spans else None,
            trained=drop_reason is None, drop_reason=drop_reason, reward_error=scored.reward_error,
            version_error=c.version_error, answer_error=c.answer_error,
            **({"turns": episode.turns, "end": episode.end, "episode_error": episode.error,
                "messages": episode.messages[len(scored.drawn.task.messages):]} if episode else {}))


def carries_gradient(group: list[Scored]) -> bool:
    """Whether a group's advantages are not all 0: two usable samples at least, rewards not all equal."""
    return len({scored.reward for scored in group}) > 1


def batch_figures(records: list[RolloutRecord]) -> Figures:
    rewards = [r.reward for r in records if r.reward is not None]
    return Figures(samples=len(records),
                   reward_mean=sum(rewards) / len(rewards) if rewards else None,
                   completion_tokens_mean=sum(r.completion_tokens for r in records) / len(records) if records else None)


def env_figures(records: list[RolloutRecord]) -> dict[str, EnvFigures]:
    """Per environment, of one batch's rollouts: groups sampled, samples generated and trained,
    mean reward of those scored."""
    out: dict[str, EnvFigures] = {}
    for name in sorted({r.env for r in records}):
        mine = [r for r in records if r.env == name]
        out[name] = EnvFigures(**batch_figures(mine).model_dump(), groups=len({r.group for r in mine}),
                               trained_samples=sum(r.trained for r in mine))
    return out


def worker_figures(records: list[RolloutRecord], seconds: float) -> dict[str, WorkerFigures]:
    """Per worker, of one batch's rollouts: completions served, their tokens, and those tokens
    per second of the batch's sampling time."""
    served: dict[str, list[RolloutRecord]] = {}
    for record in records:
        served.setdefault(record.worker, []).append(record)
    return {worker: WorkerFigures(completions=len(mine), completion_tokens=(tokens := sum(r.completion_tokens for r in mine)),
                                  tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
            for worker, mine in served.items()}
