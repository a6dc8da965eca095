"""`fleetrl sft`: the assistant-token mask in SmolLM2's chat template, the data's rows and their
one-line errors, packing, the loss against a plain per-sequence NLL, and an exact resume (a tiny
random Llama on the CPU, one rank)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from fleetrl import cli
from fleetrl.config import ModelConfig, SftConfig, load_config
from fleetrl.errors import FleetrlError
from fleetrl.model import resolve_model
from fleetrl.records import SftLine
from fleetrl.rundir import RunDir
from fleetrl.sft_data import Sequence, SftData, conversation_tokens
from fleetrl.trainer.distributed import World
from fleetrl.trainer.model import load_policy
from fleetrl.trainer.schedule import Schedule
from fleetrl.trainer.sft import rank_plans, sequence_sample, sft_step, train_sft
from fleetrl.trainer.step import StepConfig, build_optimizer
from tests.unit.test_trainer_step import CPU, VOCAB, save_tiny_model

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(ModelConfig(), log=lambda *_: None))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(path)
    return path


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def trained_text(tokenizer, sequence: Sequence) -> str:
    return tokenizer.decode([t for t, m in zip(sequence.token_ids, sequence.loss_mask) if m])


def test_the_loss_sees_each_assistant_message_and_its_end_of_turn_token_only(tokenizer):
    sequence = conversation_tokens(tokenizer, CONVERSATION, "here")
    assert sequence.token_ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert trained_text(tokenizer, sequence) == "Hello there<|im_end|>4<|im_end|>"
    # Two runs of trained tokens, each ending on <|im_end|>; the newline after it is context.
    starts = [i for i in range(1, len(sequence.loss_mask)) if sequence.loss_mask[i] and not sequence.loss_mask[i - 1]]
    assert len(starts) == 2
    assert tokenizer.decode(sequence.token_ids[:starts[0]]).endswith("<|im_start|>assistant\n")


def test_a_template_that_rewrites_the_start_of_a_conversation_is_refused_naming_the_row(tokenizer):
    rewriting = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    rewriting.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    with pytest.raises(FleetrlError, match=r"^here: the chat template renders the conversation up to message 2 "
                                           r"differently") as caught:
        conversation_tokens(rewriting, CONVERSATION, "here")
    assert "\n" not in str(caught.value)


def test_prompt_completion_pairs_are_a_user_turn_then_the_assistants(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Say hi", "completion": "hi"},
                                                  {"prompt": "Say bye", "completion": "bye"}])
    data = SftData(SftConfig(path=path), tokenizer, seed=0)
    sequence = data.sequence(1)
    assert sequence.token_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say bye"}, {"role": "assistant", "content": "bye"}], tokenize=True,
        return_dict=False)
    assert trained_text(tokenizer, sequence) == "bye<|im_end|>"


def test_each_pass_visits_every_row_once_in_a_seeded_order(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(10)])
    data = SftData(SftConfig(path=path, sequences_per_step=4), tokenizer, seed=3)
    rows = [row for step in range(1, 6) for row in data.step_rows(step)]  # 2 passes
    assert sorted(rows[:10]) == sorted(rows[10:]) == list(range(10))
    assert rows[:10] != rows[10:]  # each pass reshuffled
    again = SftData(SftConfig(path=path, sequences_per_step=4), tokenizer, seed=3)
    assert again.step_rows(4) == data.step_rows(4)  # the step and the seed alone decide
    assert SftData(SftConfig(path=path, sequences_per_step=4), tokenizer, seed=4).step_rows(1) != data.step_rows(1)


@pytest.mark.parametrize("rows, fields, error", [
    ([{"text": "x"}], {}, r"\S+/data.jsonl: no field 'messages' \(sft.messages_field\), nor both 'prompt' and "
                          r"'completion'"),
    ([{"messages": CONVERSATION}, {"messages": "hello"}], {},
     r"data.jsonl row 1: field 'messages' is a string here, an array in the rows before it"),
    ([{"messages": CONVERSATION}, {"messages": [{"role": "user"}]}], {},
     r"data.jsonl row 1: field 'messages' has a message without 'content'"),
    ([{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}], {},
     r"data.jsonl row 1: field 'messages': no assistant message to train on"),
    ([{"messages": CONVERSATION}, {"messages": CONVERSATION[:2] + [{"role": "assistant", "content": "w " * 600}]}],
     {}, r"data.jsonl row 1: \d+ tokens in the chat template, more than sft.max_tokens = 512"),
    ([{"q": "a", "completion": "b"}, {"q": "c"}], {"sft.prompt_field": "q"},
     r"data.jsonl row 1: field 'completion' is missing"),
    ([{"prompt": "a", "completion": 3}], {}, r"data.jsonl row 0: field 'completion' is a number, not text"),
])
def test_a_bad_row_is_one_line_naming_the_file_row_and_field_at_dry_run(tmp_path, capsys, rows, fields, error):
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    run_dir = tmp_path / "run"
    flags = [f"--{key}={value}" for key, value in {"sft.path": path, "sft.max_tokens": "512", **fields}.items()]
    assert cli.main(["sft", *flags, f"--run.dir={run_dir}", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fleetrl: error: ") and __import__("re").search(error, err), err
    assert not run_dir.exists()


def test_sft_without_data_or_with_rows_longer_than_a_micro_batch_is_refused(capsys, tmp_path):
    assert cli.main(["sft", f"--run.dir={tmp_path / 'run'}", "--dry-run"]) == 1
    assert capsys.readouterr().err == ("fleetrl: error: fleetrl sft needs its data: set sft.path (a .jsonl, .json, "
                                       ".parquet or .csv file, or a folder that `datasets` saved)\n")
    assert cli.main(["sft", "--sft.max_tokens=5000", "--dry-run"]) == 1
    assert "sft.max_tokens = 5000 is more than trainer.micro_batch_tokens = 4096" in capsys.readouterr().err


def random_sequences(count: int, seed: int = 0, longest: int = 12) -> list[Sequence]:
    """Sequences that all begin with token 1 (as a chat template's do), a random half of each trained."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = [1] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(2, longest))]
        mask = [0] + [rng.randint(0, 1) for _ in ids[1:]]
        mask[-1] = 1
        out.append(Sequence(ids, mask))
    return out


def test_short_sequences_share_rows_and_a_micro_batch_stays_within_its_tokens():
    sequences = random_sequences(40)
    samples = [sequence_sample(s) for s in sequences]
    for world_size in (1, 2, 3):
        plans = rank_plans(samples, 64, world_size)
        packed = [u for plan in plans for micro in plan for u in micro]
        assert sorted(id(s) for u in packed for s in u.samples) == sorted(map(id, samples))  # each once
        for plan in plans:
            for micro in plan:
                assert len(micro) * max(u.tokens for u in micro) <= 64
        tokens = sum(len(s.token_ids) for s in sequences)
        # Rows are filled: 40 sequences of ~8 tokens take a handful of forwards, not 40.
        assert sum(len(plan) for plan in plans) <= tokens // 64 + 2 * world_size
        assert max(len(u.samples) for u in packed) >= 4


def plain_nll(model, sequences: list[Sequence]) -> torch.Tensor:
    """The mean NLL over the trained tokens, one unpadded forward per sequence."""
    total, count = torch.zeros(()), 0
    for s in sequences:
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([s.token_ids])).logits[0].float(), -1)
        for i in range(1, len(s.token_ids)):
            if s.loss_mask[i]:
                total = total - logprobs[i - 1, s.token_ids[i]]
                count += 1
    return total / count


def test_the_packed_loss_and_gradient_are_a_plain_per_sequence_nlls(model_dir):
    sequences = random_sequences(24, seed=1)
    plain = load_policy(model_dir, CPU)
    loss = plain_nll(plain, sequences)
    loss.backward()
    plain_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in plain.parameters()])).item()

    model = load_policy(model_dir, CPU)
    cfg = StepConfig(schedule=Schedule(lr=1e-3), max_grad_norm=1e9, micro_batch_tokens=48)
    metrics = sft_step(model, build_optimizer(model, cfg), 1, sequences, cfg)
    assert metrics.micro_batches > 1  # the sum runs over several micro-batches
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
    assert metrics.grad_norm == pytest.approx(plain_norm, rel=1e-4)
    assert metrics.loss_tokens == sum(sum(s.loss_mask) for s in sequences)
    assert metrics.tokens == sum(len(s.token_ids) for s in sequences)


class SftRunOnOneRank:
    def __init__(self, model_dir, root, max_steps: int, *overrides: tuple[str, str]):
        self.config = load_config([], [("run.max_steps", str(max_steps)), ("trainer.lr", "1e-3"),
                                       ("trainer.checkpoint_interval", "2"), ("trainer.micro_batch_tokens", "48"),
                                       *overrides])
        self.run_dir = RunDir(root, kind="sft")
        self.model_dir = model_dir
        self.losses, self.final = {}, None

    def sequences(self, step: int) -> list[Sequence]:
        return random_sequences(6, seed=step)

    def write_final(self, named) -> None:
        self.final = {name: tensor.clone() for name, tensor in named()}

    def train(self) -> None:
        train_sft(self.config, self.run_dir, self.model_dir, World(0, 1, CPU), self.sequences,
                  lambda metrics, started, finished: self.losses.__setitem__(metrics.step, metrics.loss),
                  self.write_final, log=lambda *_: None)


def test_a_resumed_run_ends_with_the_weights_of_one_never_stopped(model_dir, tmp_path):
    whole = SftRunOnOneRank(model_dir, tmp_path / "whole", 4)
    whole.train()
    half = SftRunOnOneRank(model_dir, tmp_path / "resumed", 2)
    half.train()
    resumed = SftRunOnOneRank(model_dir, tmp_path / "resumed", 4)
    resumed.train()
    assert sorted(resumed.losses) == [3, 4]  # it went on from the checkpoint of step 2
    assert {**half.losses, **resumed.losses} == whole.losses
    assert resumed.final.keys() == whole.final.keys()
    for name, tensor in whole.final.items():
        assert torch.equal(resumed.final[name], tensor), name


def test_with_lora_the_adapter_alone_trains_and_is_handed_over(model_dir, tmp_path):
    """trainer.lora: the final weights are the adapter's (the run's writer merges them into the
    base, as `fleetrl rl`'s does), the base's are untouched, and the loss still goes down."""
    run = SftRunOnOneRank(model_dir, tmp_path / "lora", 4, ("trainer.lora.rank", "4"), ("trainer.lr", "1e-2"))
    run.sequences = lambda step: random_sequences(6, seed=0)  # the same rows at every step: learnt by heart
    run.train()
    assert run.final and all("lora_" in name for name in run.final)
    assert any(tensor.abs().sum() > 0 for name, tensor in run.final.items() if "lora_B" in name)
    assert run.losses[4] < run.losses[1]


def test_a_run_dir_of_the_other_kind_of_run_is_refused_in_one_line_before_it_is_touched(tmp_path):
    """`fleetrl rl` on an sft run's directory once found its checkpoint and failed on its metrics."""
    from fleetrl.app.rl import find_resume
    from fleetrl.rundir import plot_run

    sft = RunDir(tmp_path / "run", kind="sft")
    sft.start(load_config([], [("run.dir", str(sft.root))]), 0)
    sft.close()
    assert sft.kind_path.read_text() == "sft\n" and RunDir.of(sft.root).lines is SftLine
    before = sorted(p.name for p in sft.root.iterdir())
    with pytest.raises(FleetrlError, match=rf"^run.dir {sft.root} holds a `fleetrl sft` run; a `fleetrl rl` run needs"):
        find_resume(RunDir(sft.root))
    assert sorted(p.name for p in sft.root.iterdir()) == before
    with pytest.raises(FleetrlError, match="holds a `fleetrl sft` run, which draws no plots"):
        plot_run(sft.root)


def test_the_final_model_of_sft_is_policy_version_0(monkeypatch, tmp_path):
    """It was labelled v{max_steps}, which `fleetrl eval` showed while `fleetrl rl` on it starts at v0."""
    from fleetrl.app import sft

    versions = []
    monkeypatch.setattr(sft, "write_final_model", lambda config, run_dir, model_dir, named, version, log, **_: versions.append(version))
    sft.SftRun(load_config([], [("run.dir", str(tmp_path / "run")), ("run.max_steps", "20")])).write_final(iter)
    assert versions == [0]


def test_a_resume_whose_model_folder_or_data_file_changed_is_refused_in_one_line(tmp_path):
    """model.path was compared as a string, but SFT_RUN/final_model is rewritten whenever that run
    is resumed: a LoRA run (its checkpoints hold the adapter alone) would resume on other weights."""
    model, data = tmp_path / "model", tmp_path / "data.jsonl"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"a" * 10)
    data.write_text("{}\n")
    run = RunDir(tmp_path / "run", kind="sft")
    config = load_config([], [("run.dir", str(run.root))])
    run.start(config, 0, {"model.path": model, "sft.path": data})
    run.close()
    run.start(config, 2, {"model.path": model, "sft.path": data})  # the same files: it resumes
    run.close()
    (model / "model.safetensors").write_bytes(b"b" * 10)  # the same size
    with pytest.raises(FleetrlError, match=rf"^run.dir {run.root}: resume with model.path '{model}', whose files changed"):
        run.start(config, 2, {"model.path": model, "sft.path": data})
    data.write_text("[]\n")
    with pytest.raises(FleetrlError, match=rf"^run.dir {run.root}: resume with sft.path '{data}', whose files changed"):
        run.start(config, 2, {"sft.path": data})


def test_only_the_sft_keys_that_change_its_rows_define_an_sft_run(tmp_path):
    run = RunDir(tmp_path / "run", kind="sft")
    config = load_config([], [("run.dir", str(run.root))])
    run.start(config, 0)
    run.close()
    changed = load_config([run.config_path], [("orchestrator.group_size", "4"), ("sft.max_tokens", "64")])
    run.start(changed, 2)  # an rl key, and the longest row allowed: the same rows in the same order
    run.close()
    with pytest.raises(FleetrlError, match=r"resume with sft.sequences_per_step 3 but the run was started with 32"):
        run.start(load_config([run.config_path], [("sft.sequences_per_step", "3")]), 2)
