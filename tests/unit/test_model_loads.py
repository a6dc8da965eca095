"""Two model loads in one process never overlap (`trainer.model.load_policy`): transformers
patches module creation process-wide while it loads, so a model built on another thread
meanwhile comes out on the meta device (issue 25: the attach run's crash)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.models.llama import modeling_llama

from fleetrl.trainer.model import load_policy
from tests.unit.test_trainer_step import save_tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(path)
    return path


def test_a_load_started_inside_another_loads_window_waits_for_it(model_dir, monkeypatch):
    """The first load is held inside its window (its model built under transformers' loading
    patches, its weights not yet read) until the second load has returned, or, where the second
    waits for the first (the fix), for a few seconds. Without the wait the whole second load runs
    inside the first's window, every time: its tied head is never tied (transformers disables
    `tie_weights` process-wide while it loads) and stays on the meta device."""
    inside, second_done = threading.Event(), threading.Event()
    first_thread = None  # the loading thread, below
    post_init = modeling_llama.LlamaForCausalLM.post_init

    def held_post_init(self):
        post_init(self)
        if threading.current_thread() is first_thread:
            inside.set()
            second_done.wait(timeout=3)  # with the fix the second load waits for this one instead

    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "post_init", held_post_init)
    loaded, failed = {}, []

    def first_load():
        try:
            loaded["first"] = load_policy(model_dir, CPU, sharded=False)
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(e)

    first = threading.Thread(target=first_load)
    first_thread = first
    first.start()
    assert inside.wait(timeout=60), "the first load never reached its window"
    try:
        loaded["second"] = load_policy(model_dir, CPU, sharded=False)
    finally:
        second_done.set()
        first.join(timeout=60)
    assert not failed, failed
    for name, model in loaded.items():
        for pname, param in model.named_parameters():
            assert param.device == CPU and not param.is_meta, f"{name} load: {pname} on {param.device}"
    reference = dict(loaded["first"].named_parameters())
    for pname, param in loaded["second"].named_parameters():
        assert torch.equal(param, reference[pname]), pname
    assert loaded["second"].lm_head.weight is loaded["second"].model.embed_tokens.weight  # tied, as saved
