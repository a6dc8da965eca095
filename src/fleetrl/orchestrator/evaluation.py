"""Evaluation during training: held-out prompts, sampled at one exact version, scored, recorded.
Every `eval.every_steps` steps, at the last step and for the version the run starts from, the
trainer waits while the fleet samples the same `eval.prompts` held-out prompts of each evaluated
environment; `fleetrl verify` checks the records' spans (rundir.check_eval). When it runs, where
the prompts come from and what each figure means: docs/environments.md, "Evaluation and the
held-out split"."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace
from itertools import islice

from fleetrl.config import EvalConfig
from fleetrl.envs import env_tools, is_multi_turn
from fleetrl.envs.base import eval_stream
from fleetrl.envs.mix import Drawn, RunEnv
from fleetrl.inference.types import GenerateRequest
from fleetrl.orchestrator.chat import ChatTokens
from fleetrl.orchestrator.episodes import run_episode
from fleetrl.orchestrator.rollouts import Orchestrator, Scored
from fleetrl.records import EvalFigures, EvalLine, RolloutRecord
from fleetrl.rundir import RunDir, eval_summary


def pass_at_k(samples: int, passed: int, k: int) -> float:
    """The chance that at least one of k completions drawn from `samples` (`passed` of which
    pass) passes: 1 - C(samples - passed, k) / C(samples, k)."""
    if samples - passed < k:
        return 1.0
    return 1.0 - math.comb(samples - passed, k) / math.comb(samples, k)


def standard_error(values: list[float]) -> float | None:
    """The standard error of the mean of `values`: their sample standard deviation / sqrt(n);
    None for fewer than two."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


class Evaluator:
    def __init__(self, orchestrator: Orchestrator, envs: list[RunEnv], config: EvalConfig, seed: int,
                 held_out_only: bool, run_dir: RunDir, last_step: int, log=print) -> None:
        """`envs`: what to evaluate on; `held_out_only`: they are the run's own environments,
        evaluated on their held-out split alone (an environment without one is an EnvError);
        `last_step`: run.max_steps."""
        self.orchestrator = orchestrator
        self.config = config
        self.run_dir = run_dir
        self.last_step = last_step
        self.log = log
        self.done = {line.version for line in run_dir.read_evals()}  # a resumed run's stand
        self.prompts = {e.name: [Drawn(e, task, f"{e.name}/{task.id}")
                                 for task in islice(eval_stream(e.env, seed, held_out_only), config.prompts)]
                        for e in envs}
        self.sampling = replace(orchestrator.sampling, temperature=0.0 if config.greedy else 1.0)
        self.multi_turn = {e.name: is_multi_turn(e.env) for e in envs}
        self.tool_schemas = {e.name: [tool.schema() for tool in env_tools(e.env)] for e in envs}
        self.chat = orchestrator.chat
        if self.chat is None and any(self.multi_turn.values()):
            self.chat = ChatTokens(orchestrator.tokenizer)

    def due(self, version: int, start: bool = False) -> bool:
        """Whether `version` is to be evaluated: the version the run starts from (`start`), every
        eval.every_steps-th and the last; none twice (a resumed run keeps its earlier ones)."""
        every = self.config.every_steps
        return version not in self.done and (start or version % every == 0 or version == self.last_step)

    async def evaluate(self, version: int) -> dict[str, EvalFigures]:
        """Samples and scores every prompt at `version`, which the fleet must serve and keep
        serving meanwhile; writes the records and eval.jsonl's line; returns the figures."""
        started = time.time()
        self.done.add(version)
        step = version + 1  # the step whose policy this is: an episode's k bound counts from it
        groups = await asyncio.gather(*(self._sample(step, index, drawn, version) for index, drawn in
                                        enumerate(d for prompts in self.prompts.values() for d in prompts)))
        records, figures = [], {}
        for name in self.prompts:
            mine = [group for group in groups if group[0][0].drawn.env.name == name]
            figures[name] = self._figures(mine)
            records += [record for group in mine for _, record in group]
        seconds = time.time() - started
        self.run_dir.write_eval(records, EvalLine(version=version, started=started, seconds=seconds, envs=figures))
        self.log(f"fleetrl: evaluated v{version} in {seconds:.1f} s: {eval_summary(figures)}")
        return figures

    async def _sample(self, step: int, index: int, drawn: Drawn, version: int) -> list[tuple[Scored, RolloutRecord]]:
        """One prompt's completions, scored, each with its record."""
        orchestrator, name, n = self.orchestrator, drawn.env.name, self.config.samples_per_prompt
        session = f"eval-v{version}-prompt{index}"
        if self.multi_turn[name]:
            prompt_ids = await orchestrator.prompt_ids(drawn, self.tool_schemas[name])
            episodes = await asyncio.gather(*(
                run_episode(orchestrator.fleet, drawn.env.env, self.chat, orchestrator.decode, drawn.task, prompt_ids,
                            self.sampling, session, step, f"{session}-sample{i}", orchestrator.limits)
                for i in range(n)))
            scored = await asyncio.gather(*(orchestrator.score_completion(step, drawn, prompt_ids, e.response(), e)
                                            for e in episodes))
        else:
            prompt_ids = await orchestrator.prompt_ids(drawn)
            completions = await orchestrator.fleet.generate(GenerateRequest(
                prompt_token_ids=prompt_ids, sampling=self.sampling, n=n, session_id=session))
            scored = await asyncio.gather(*(orchestrator.score_completion(step, drawn, prompt_ids, c)
                                            for c in completions))
        out = []
        for s in scored:
            reason = orchestrator.unusable(s)
            if reason is None and {span.version for span in s.completion.spans} != {version}:
                reason = "misversioned"  # never, while the trainer waits: the check that it holds
            # Filed under the version it scores (eval/step_N.jsonl), and never trained.
            record = orchestrator.record(step, index, s, None, reason)
            out.append((s, record.model_copy(update={"step": version, "trained": False})))
        return out

    def _figures(self, groups: list[list[tuple[Scored, RolloutRecord]]]) -> EvalFigures:
        k = self.config.samples_per_prompt
        per_prompt = [usable for group in groups
                      if (usable := [s.reward for s, record in group if record.drop_reason is None])]
        rewards = [r for usable in per_prompt for r in usable]
        passes = [(len(usable), sum(r >= self.config.pass_reward for r in usable)) for usable in per_prompt]
        pass_at = {1: sum(pass_at_k(n, c, 1) for n, c in passes) / len(passes) if passes else None}
        if k > 1:
            full = [(n, c) for n, c in passes if n >= k]
            pass_at[k] = sum(pass_at_k(n, c, k) for n, c in full) / len(full) if full else None
        return EvalFigures(
            prompts=len(groups),
            samples=sum(len(group) for group in groups),
            failed=sum(record.drop_reason is not None for group in groups for _, record in group),
            reward_mean=sum(rewards) / len(rewards) if rewards else None,
            reward_se=standard_error([sum(usable) / len(usable) for usable in per_prompt]),
            pass_at=pass_at)
