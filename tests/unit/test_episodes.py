"""Multi-turn episodes against the in-process fake fleet, with a ChatML tokenizer of characters:
token-exact growth, masks, per-turn spans, off-policy stops, and tools or environments that fail."""

import asyncio
import json
import re
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fleetrl.config import OrchestratorConfig
from fleetrl.envs import Task
from fleetrl.envs.mix import RunEnv
from fleetrl.envs.tools import Tool
from fleetrl.errors import FleetrlError
from fleetrl.inference.fleet import Fleet
from fleetrl.orchestrator import episodes
from fleetrl.orchestrator.chat import ChatTokens
from fleetrl.orchestrator.rollouts import Orchestrator
from fleetrl.rundir import RunDir, VerifyError, check_turns

from .fake_fleet import FakeProvider, FakeTransport

# The fake engine's tokens are 1000 * version + i: the template's tokens lie above them all.
SPECIAL = {"<|im_start|>": 100_001, "<|im_end|>": 100_002}
TEXT = 200_000  # + a character's code point


class ChatML:
    """ChatML over characters (a token per character), like SmolLM2's template. Decoding
    the fake engine's tokens gives `says`: what the test wants the model to have said."""

    eos_token_id = SPECIAL["<|im_end|>"]

    def __init__(self, says: str = "<answer>1</answer>") -> None:
        self.says = says

    def encode(self, text, add_special_tokens=False):
        ids = []
        for piece in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            ids += [SPECIAL[piece]] if piece in SPECIAL else [TEXT + ord(c) for c in piece]
        return ids

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, **_):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.encode(text + ("<|im_start|>assistant\n" if add_generation_prompt else ""))

    def decode(self, ids, **_):
        if any(i < SPECIAL["<|im_start|>"] for i in ids):
            return self.says
        return "".join(chr(i - TEXT) for i in ids if i >= TEXT)


class Retry:
    """Answers every turn with feedback, so an episode runs to max_turns; counts its answers."""

    name = "retry"
    tools: list[Tool] = []

    def __init__(self, answer=lambda task, messages: [{"role": "user", "content": "again"}]) -> None:
        self._answer = answer
        self.seen: list[list[dict]] = []
        self.ended: list[tuple[str, int, str]] = []

    def tasks(self, seed):
        i = 0
        while True:
            yield Task(id=f"t{i}", messages=[{"role": "user", "content": f"q{i}"}], answer=None)
            i += 1

    def respond(self, task, messages, state):
        self.seen.append(list(messages))
        state["answers"] = state.get("answers", 0) + 1  # kept across the episode's turns
        return self._answer(task, messages)

    def episode_ended(self, task, state, end):
        self.ended.append((state["episode"], state.get("answers", 0), end))

    def reward(self, rollout):
        return (len(rollout.messages) % 5) / 5


async def make(env, tokenizer=None, k=0, max_turns=3, step_s=0.001, **options):
    run_dir = RunDir(Path(tempfile.mkdtemp(prefix="fleetrl-episodes-")))
    provider = FakeProvider("a", "b", step_s=step_s)
    fleet = Fleet(provider, discovery_interval_s=3600, log=lambda *_: None)
    await fleet.start()
    config = OrchestratorConfig(max_off_policy_steps=k, batch_prompts=2, group_size=2, max_tokens=5,
                                max_turns=max_turns, **options)
    orch = Orchestrator(fleet, [RunEnv(env.name, env)], tokenizer or ChatML(), config, run_dir=run_dir, seed=0, max_context=4096,
                        log=lambda *_: None)
    return fleet, orch, FakeTransport(provider)


def records(orch, step):
    return [json.loads(line) for line in orch.run_dir.rollouts_path(step).read_text().splitlines()]


def test_the_tokens_between_turns_are_the_templates_and_the_end_of_turn_is_not_doubled():
    tokenizer = ChatML()
    chat = ChatTokens(tokenizer)
    end = SPECIAL["<|im_end|>"]
    assert chat.closing == [end, TEXT + ord("\n")]
    reply = [{"role": "user", "content": "no"}]
    rendered = tokenizer.encode("\n<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n")
    assert chat.between_turns([50, end], reply) == rendered  # stopped on <|im_end|>: only the newline is added
    assert chat.between_turns([50, 51], reply) == [end] + rendered  # cut by max_tokens: the turn is closed
    # Token-exact: prompt + turn + between + turn is the template's rendering of the whole conversation.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True)
    turn = tokenizer.encode("a<|im_end|>")
    whole = prompt + turn + chat.between_turns(turn, reply)
    assert whole == tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                                   *reply], add_generation_prompt=True)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    class Rewrites(ChatML):
        def apply_chat_template(self, messages, **options):  # empties assistant turns once others follow
            kept = [{**m, "content": ""} if m["role"] == "assistant" and i < len(messages) - 1 else m
                    for i, m in enumerate(messages)]
            return super().apply_chat_template(kept, **options)

    with pytest.raises(FleetrlError, match="renders the conversation before the messages \\['user'\\] differently"):
        ChatTokens(Rewrites())


async def test_an_episode_holds_every_turn_with_masks_logprobs_and_a_span_per_turn():
    env = Retry()
    fleet, orch, _ = await make(env, max_turns=3)
    batch = await orch.make_batch(1)
    assert len(batch.samples) == 4 and "off_policy" not in batch.meta.dropped_by
    for sample in batch.samples:
        assert len(sample.turns) == 3
        model = [i for start, end in sample.turns for i in range(start, end)]
        assert [i for i, m in enumerate(sample.loss_mask) if m] == model
        assert all(sample.completion_ids[i] < TEXT for i in model)  # the engine's
        assert all(sample.completion_ids[i] >= SPECIAL["<|im_start|>"] for i in range(len(sample.completion_ids)) if i not in model)
        assert all(sample.inference_logprobs[i] == 0.0 for i in range(len(sample.completion_ids)) if i not in model)
        assert [s.start for s in sample.spans] == [start for start, _ in sample.turns]
        check_turns("sample", sample)  # what `fleetrl verify` checks
    # The environment saw the conversation grow, its own answers in it, and never a fourth turn.
    assert sorted(sum(m["role"] == "assistant" for m in seen) for seen in env.seen) == [1] * 4 + [2] * 4
    assert {r["end"] for r in records(orch, 1)} == {"max_turns"}
    # Each episode kept its own state across its turns, and was told once how it ended.
    assert sorted(env.ended) == [(f"step1-group{g}-sample{s}", 2, "max_turns") for g in range(2) for s in range(2)]
    await fleet.close()


def gated():
    """An environment whose answers wait until the test has published: every second turn then
    runs on the new weights."""
    published = threading.Event()

    def answer(task, messages):
        published.wait(10)
        return [{"role": "user", "content": "again"}]

    return Retry(answer), published


async def publish_once_answers_wait(fleet, env, published, transport):
    while not env.seen:
        await asyncio.sleep(0.005)
    await fleet.publish(1, transport, lambda: iter([]))
    published.set()


async def test_a_publish_between_turns_gives_the_later_turns_the_new_version():
    env, published = gated()
    fleet, orch, transport = await make(env, k=1, max_turns=2, step_s=0.02)
    pending = asyncio.create_task(orch.make_batch(2))  # admitted at v0 with k = 1
    await publish_once_answers_wait(fleet, env, published, transport)
    batch = await pending
    assert "off_policy" not in batch.meta.dropped_by and batch.meta.distance_max == 1
    for sample in batch.samples:
        (first, _), (second, _) = sample.turns
        versions = {s.start: s.version for s in sample.spans}
        assert versions[first] == 0 and versions[second] == 1
        assert [s.version for s in sample.spans if s.start >= second] == [1]
        check_turns("sample", sample)
    await fleet.close()


async def test_an_episode_past_k_is_stopped_after_its_turn_and_dropped(monkeypatch):
    """Admission and the turns' version floor bypassed (the defence behind them): batch 3 at
    k = 0 sampled at v0 is 2 versions behind after its first turn, so no second turn is sampled
    and every episode is dropped."""
    env = Retry()
    fleet, orch, _ = await make(env, k=0, max_turns=3)

    async def no_admission(version):
        return None

    monkeypatch.setattr(fleet, "wait_for_version", no_admission)
    monkeypatch.setattr(episodes, "turn_min_version", lambda *_: None)
    with pytest.raises(FleetrlError, match="^batch 3 is empty: of 4 samples 4 exceeded"):
        await orch.make_batch(3)
    assert [(r["end"], r["drop_reason"], len(r["turns"])) for r in records(orch, 3)] == [("off_policy", "off_policy", 1)] * 4
    assert env.seen == []  # stopped before the environment was asked for a second turn
    assert {end for _, _, end in env.ended} == {"off_policy"}  # told, so it can let go of the episode
    await fleet.close()


async def test_partial_episodes_go_on_and_train_only_the_turns_within_k(monkeypatch):
    async def no_admission(version):
        return None

    env, published = gated()
    fleet, orch, transport = await make(env, k=0, max_turns=2, partial_episodes=True, step_s=0.02)
    monkeypatch.setattr(fleet, "wait_for_version", no_admission)
    pending = asyncio.create_task(orch.make_batch(2))  # k = 0 wants v1; the first turns run at v0
    await publish_once_answers_wait(fleet, env, published, transport)
    batch = await pending
    assert len(batch.samples) == 4 and batch.meta.distance_max == 0
    for sample in batch.samples:
        (first_start, first_end), (second_start, second_end) = sample.turns
        # Exact spans over every model token; those of v0 are context now.
        assert [s.version for s in sample.spans if s.start >= second_start] == [1]
        assert sample.loss_mask[first_start:first_end] == [0] * (first_end - first_start)
        assert sample.loss_mask[second_start:second_end] == [1] * (second_end - second_start)
        assert sample.trained_tokens() == second_end - second_start
    await fleet.close()


@pytest.mark.parametrize("fn, timeout_s, error", [
    (lambda: 1 / 0, 5.0, "env retry: tool boom on task t[01] raised ZeroDivisionError: division by zero"),
    (lambda: time.sleep(30), 0.2, "env retry: tool boom on task t[01] took longer than its timeout_s = 0.2 s"),
])
async def test_a_tool_that_fails_ends_its_episode_not_the_run(fn, timeout_s, error):
    env = Retry()
    env.tools = [Tool(name="boom", fn=fn, description="fails", timeout_s=timeout_s)]
    says = '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
    fleet, orch, _ = await make(env, ChatML(says), max_turns=3)
    logged = []
    orch.log = logged.append
    with pytest.raises(FleetrlError, match="4 tool_failed"):
        await orch.make_batch(1)
    rows = records(orch, 1)
    assert {(r["drop_reason"], len(r["turns"])) for r in rows} == {("tool_failed", 1)}
    assert all(re.fullmatch(error, r["episode_error"]) for r in rows)
    assert len(logged) == 1 and logged[0].startswith("fleetrl: batch 1: dropped 4 episode(s) ended by a failure of a tool")
    await fleet.close()


async def test_tool_results_and_badly_written_calls_are_answered_as_tool_messages():
    calls = []
    env = Retry()
    env.tools = [Tool(name="echo", fn=lambda text: calls.append(text) or f"echo {text}", description="echoes")]
    says = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call><tool_call>{"name": "nope"}</tool_call>'
    fleet, orch, _ = await make(env, ChatML(says), max_turns=2)
    await orch.make_batch(1)
    answered = records(orch, 1)[0]["messages"][1:3]
    assert answered == [{"role": "tool", "content": "echo hi"},
                        {"role": "tool", "content": "error: no tool named 'nope' (tools: echo)"}]
    assert env.seen == [] and len(calls) == 4  # tools answered every turn; the environment never had to
    await fleet.close()


async def test_an_environment_answer_that_fails_drops_its_episode():
    env = Retry(lambda task, messages: "not a list")
    fleet, orch, _ = await make(env)
    with pytest.raises(FleetrlError, match="4 env_failed"):
        await orch.make_batch(1)
    assert {r["episode_error"] for r in records(orch, 1)} == {
        "env retry: answer to turn 1 of task t0 is 'not a list', not None or a non-empty list of {role, content} messages",
        "env retry: answer to turn 1 of task t1 is 'not a list', not None or a non-empty list of {role, content} messages",
    }
    await fleet.close()


async def test_an_episode_whose_next_turn_would_not_fit_ends_there():
    env = Retry()
    fleet, orch, _ = await make(env, max_turns=4)
    orch.limits = type(orch.limits)(**{**orch.limits.__dict__, "max_context": 40})
    await orch.make_batch(1)
    assert {(r["end"], len(r["turns"])) for r in records(orch, 1)} == {("context", 1)}
    await fleet.close()


def test_verify_refuses_a_span_on_environment_tokens_and_a_trained_environment_token():
    from fleetrl.batch import Sample
    from fleetrl.versions import VersionSpan

    def sample(mask, spans):
        return Sample(prompt_ids=[1], completion_ids=[5, 5, 9, 5], inference_logprobs=[0.0] * 4,
                      spans=[VersionSpan(v, s) for v, s in spans], reward=1.0, advantage=0.0, group=0,
                      loss_mask=mask, turns=[[0, 2], [3, 4]])

    check_turns("ok", sample([1, 1, 0, 1], [(0, 0), (1, 3)]))
    with pytest.raises(VerifyError, match="opens at token 2, which the environment wrote"):
        check_turns("s", sample([1, 1, 0, 1], [(0, 0), (1, 2), (1, 3)]))
    with pytest.raises(VerifyError, match="the loss sees token 2, which the environment wrote"):
        check_turns("s", sample([1, 1, 1, 1], [(0, 0), (1, 3)]))
    with pytest.raises(VerifyError, match="the model turn at token 3 opens no version span"):
        check_turns("s", sample([1, 1, 0, 1], [(0, 0)]))
    with pytest.raises(VerifyError, match="go back in version"):
        check_turns("s", sample([1, 1, 0, 1], [(1, 0), (0, 3)]))


def test_an_episode_names_every_worker_that_served_its_turns_prefill_included():
    from fleetrl.inference.types import GenerateResponse
    from fleetrl.orchestrator.episodes import Episode
    from fleetrl.versions import VersionSpan

    episode = Episode(task=Task("t", [], None), prompt_ids=[1], messages=[], state={})
    for worker, prefill in (("d0", "p0"), ("d0", "p1"), ("d0", "p0")):
        episode.add_model_turn(GenerateResponse("r", [5], [-0.1], "stop", worker, [VersionSpan(0, 0)],
                                                prefill_worker_id=prefill))
        episode.add_environment_tokens([9])
    response = episode.response()
    assert response.worker_id == "d0" and response.prefill_worker_id == "p0+p1"
    assert [s.start for s in response.spans] == [0, 2, 4] and episode.loss_mask == [1, 0] * 3

