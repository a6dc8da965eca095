"""Nothing on the control loop's side of `fleetrl rl` changes process-global state (issue 27,
item 1): the trainer runs on the main thread meanwhile, and would find the environment variables,
torch's defaults, the RNGs, logging or a model load changed under it. Whole `fleetrl rl` runs
(the command line, a tiny model, the in-process fake fleet), with every known setter recorded
(`global_state`) and the tripwire armed (fleetrl/tripwire.py, which the integration suite arms on
every real run)."""

from __future__ import annotations

import json
import logging
import random
import textwrap
import threading

import pytest
import torch

from fleetrl import cli, tripwire
from fleetrl.app import rl
from fleetrl.inference.fleet import Fleet

from .fake_fleet import FakeProvider, FakeTransport
from .global_state import recording

# The fake engine's tokens are 1000 * version + position: the tiny model's vocabulary holds
# them all, up to the final sample at v2.
VOCAB = 2100
CHAT_TEMPLATE = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                 "{% if add_generation_prompt %}w1 {% endif %}")


def save_tiny_policy(path) -> None:
    """A tiny Llama, and a word-level tokenizer ("w5 w7" -> [5, 7]) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w2")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


class RunProvider(FakeProvider):
    """The fake fleet as `fleetrl rl` uses a provider: recorded in the run directory, and probed
    after every publish (it scores the probe within the tolerance the test gives the fleet)."""

    async def prompt_logprobs(self, worker, token_ids, prefill=None) -> list[float]:
        return [0.0] * (len(token_ids) - 1)

    def attach_settings(self) -> dict:
        return {"provider": "vllm", "urls": [f"fake://{e}" for e in self.engines]}


def write_tasksets(folder) -> None:
    """verifiers tasksets, importable by id as verifiers loads them: tools (served by an
    in-process MCP server) and a multi-turn Env of its own (quiz)."""
    from . import test_verifiers_adapter as tasksets

    for module, source in [("fleetrl_vf_tools", tasksets.TOOLS), ("fleetrl_vf_quiz", tasksets.QUIZ)]:
        (folder / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.mark.parametrize("env, attached", [
    ("reverse_text", False),
    ("reverse_text", True),  # the fleet takes the trainer's weights for workers it did not launch
    ("verifiers:fleetrl-vf-tools", False),
    ("verifiers:fleetrl-vf-quiz", False),
])
def test_fleetrl_rl_changes_no_process_global_state_off_the_main_thread(env, attached, tmp_path, monkeypatch):
    if env.startswith("verifiers:"):
        pytest.importorskip("verifiers.v1")
        write_tasksets(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
    # As in a process of its own: pytest has given the root logger handlers of its own.
    monkeypatch.setattr(logging.root, "handlers", [])
    model_dir = tmp_path / "model"
    save_tiny_policy(model_dir)
    provider = RunProvider("w0", "w1", step_s=0.0, launches_workers=not attached)
    monkeypatch.setattr(rl, "build_fleet", lambda config, run_dir, model_dir, adapter: Fleet(provider, probe_tolerance=1e9))
    monkeypatch.setattr(rl, "build_transport", lambda config, run_dir, target: FakeTransport(provider))
    argv = ["rl", "--model.path", str(model_dir), "--run.dir", str(tmp_path / "run"), "--run.max_steps", "2", "--run.live_view", "off",
            "--run.core_plan", "off", "--orchestrator.env", env, "--orchestrator.batch_prompts", "2",
            "--orchestrator.group_size", "2", "--orchestrator.max_tokens", "4", "--orchestrator.max_turns", "2",
            "--orchestrator.max_off_policy_steps", "1", "--inference.vllm.max_model_len", "256", "--debug"]
    if attached:
        argv += ["--inference.urls", '["fake://w0", "fake://w1"]']
    monkeypatch.setenv(tripwire.ENV, "1")  # as on every real run of the suite: an offence ends the run with 1
    with recording() as recorder:
        assert cli.main(argv) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert recorder.off_main() == []


def test_the_recorder_records_setters_called_off_the_main_thread_only():
    """The guard above can fail: the same setters, called from another thread, are recorded."""
    def change_globals():
        torch.set_default_dtype(torch.float32)
        random.seed(0)
        logging.getLogger("fleetrl-test").setLevel(logging.WARNING)

    with recording() as recorder:
        change_globals()  # the main thread: allowed
        thread = threading.Thread(target=change_globals, name="control")
        thread.start()
        thread.join()
    assert [call.split(" (")[0] for call in recorder.off_main()] == [
        "torch.set_default_dtype on thread control", "random.seed on thread control",
        "logging.Logger.setLevel on thread control"]
