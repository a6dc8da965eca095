"""`fleetrl sft` as a user runs it, as a real process with two trainer ranks (no vLLM): a tiny
random Llama with the embedded model's tokenizer and chat template learns a small set of
conversations by heart, resumes from its checkpoint for one more step, and leaves a final model
that transformers loads, that `fleetrl export` and `fleetrl verify` take."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fleetrl.rundir import RunDir
from fleetrl.trainer.export import folder_version

ROWS = [{"messages": [{"role": "user", "content": f"Repeat: {word}"}, {"role": "assistant", "content": word}]}
        for word in ("apple", "river", "stone", "cloud", "light")]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer):
    """A 2-layer Llama over the embedded model's vocabulary, with its tokenizer: fast on 2 CPUs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-chat-llama")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def fleetrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleetrl", *args], capture_output=True, text=True, timeout=300)


def test_sft_on_two_ranks_resumes_and_leaves_a_model_for_rl(tiny_model, tmp_path):
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    run = tmp_path / "sft"
    flags = ["--model.path", str(tiny_model), "--sft.path", str(data), "--sft.sequences_per_step", "5",
             "--sft.max_tokens", "128", "--trainer.world_size", "2", "--trainer.lr", "3e-3",
             "--trainer.micro_batch_tokens", "128", "--trainer.checkpoint_interval", "3", "--run.dir", str(run),
             "--run.live_view", "off"]
    first = fleetrl("sft", *flags, "--run.max_steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step 3/3  loss" in first.stdout
    resumed = fleetrl("sft", *flags, "--run.max_steps", "4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after step 3" in resumed.stdout

    lines = RunDir(run, kind="sft").read_metrics()
    assert [line.step for line in lines] == [1, 2, 3, 4]
    # Every step trains all five rows (one pass each): the loss of the same rows goes down.
    assert lines[-1].loss < lines[0].loss
    assert all(line.sequences == 5 and line.loss_tokens > 5 and not line.skipped for line in lines)
    assert (run / "tensorboard").is_dir()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final_model")
    assert AutoTokenizer.from_pretrained(run / "final_model").chat_template  # rl renders its prompts with it
    assert folder_version(run / "final_model") == 0  # no policy version: `fleetrl rl` on it starts at v0
    assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(tiny_model).config.vocab_size

    verified = fleetrl("verify", str(run))
    assert verified.returncode == 0 and "sft: 4 steps" in verified.stdout, verified.stderr
    exported = fleetrl("export", str(run), str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    final = dict(model.named_parameters())
    for name, tensor in AutoModelForCausalLM.from_pretrained(tmp_path / "exported").named_parameters():
        assert torch.equal(tensor, final[name]), name  # the last checkpoint is the final model
