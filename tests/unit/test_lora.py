"""LoRA in the trainer (`trainer.lora`, trainer/lora.py) on the tiny random Llama of the trainer
tests: the config, what trains, what a publish sends (on one and two gloo ranks), the step
sharded and not, every loss option, checkpoints, and the exports (merged and adapter folder)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from fleetrl.cli import main
from fleetrl.config import Config, ConfigError, LoraConfig, LossConfig, ModelConfig, load_config, to_toml
from fleetrl.errors import FleetrlError
from fleetrl.lora import AdapterError, adapter_key, check_complete, vllm_max_lora_rank, write_adapter, zero_adapter
from fleetrl.rundir import RUN_DEFINING
from fleetrl.trainer import checkpoint, distributed, loop
from fleetrl.trainer.export import export_hf, export_weights
from fleetrl.trainer.kept_weights import KeptWeights
from fleetrl.trainer.loop import Hooks
from fleetrl.trainer.lora import adapter_config, adapter_params, base_key, base_params
from fleetrl.trainer.model import agreement_probe, load_policy, local_shards, named_tensors
from fleetrl.trainer.step import build_optimizer, train_step
from fleetrl.versions import VersionSpan
from tests.ranks import spawn_ranks
from tests.unit.test_trainer_step import CPU, FAST, make_batch, save_tiny_model, save_tiny_tokenizer

LORA = LoraConfig(rank=4, alpha=8.0)
IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 101]])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-lora")
    save_tiny_model(path)
    save_tiny_tokenizer(path)  # export copies it
    return path


def lora_policy(model_dir, lora: LoraConfig = LORA):
    return load_policy(model_dir, CPU, adapter=adapter_config(lora, model_dir))


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def trained_lora(model_dir, steps: int = 2):
    """A LoRA policy after `steps` steps on a batch it did not sample (so its B moves off 0)."""
    model = lora_policy(model_dir)
    optimizer = build_optimizer(model, FAST)
    batch = make_batch(model, noise=0.2)
    for _ in range(steps):
        train_step(model, optimizer, batch, FAST)
    return model, optimizer, batch


# -- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value, message", [
    ("rank", "513", r"^config key 'trainer\.lora\.rank': a LoRA rank must be 1 to 512"),
    ("target_modules", '["q_proj", "lm_head"]', r"^config key 'trainer\.lora\.target_modules': lm_head cannot take"),
    ("target_modules", '["embed_tokens"]', r"^config key 'trainer\.lora\.target_modules': embed_tokens cannot"),
    ("target_modules", "[]", r"^config key 'trainer\.lora\.target_modules': names no layer"),
    ("target_modules", '["q_proj", "foo_proj"]', r"^config key 'trainer\.lora\.target_modules': foo_proj is no linear"),
    ("target_modules", '["q_proj", "q_proj"]', r"^config key 'trainer\.lora\.target_modules': names a layer twice"),
    ("dropout", "1.0", r"^config key 'trainer\.lora\.dropout'"),
    ("alpha", "0", r"^config key 'trainer\.lora\.alpha'"),
])
def test_a_bad_lora_setting_is_refused_in_one_line_naming_the_field(flag, value, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config([], [(f"trainer.lora.{flag}", value)])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kind, default", [("dynamo", "wait"), ("fleetrl", "abort")])
def test_lora_on_dynamo_pauses_without_keep_which_dynamo_refuses_under_an_adapter(kind, default):
    given = [("trainer.lora.rank", "8"), ("inference.provider", "dynamo"), ("inference.dynamo.worker", kind)]
    assert load_config([], given).inference.resolved_pause_mode() == default
    assert load_config([], given[1:]).inference.resolved_pause_mode() == ("wait" if kind == "dynamo" else "keep")
    if kind == "fleetrl":  # Dynamo's own kind takes only wait anyway
        with pytest.raises(ConfigError, match=r"inference\.pause_mode 'keep' with trainer\.lora on Dynamo: .* set "
                                              r"inference\.pause_mode = 'abort' or 'wait'") as error:
            load_config([], [*given, ("inference.pause_mode", "keep")])
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("flags, message", [
    (["--inference.urls", '["http://127.0.0.1:8001"]'], r"trainer\.lora with inference\.urls: .* unset inference\.urls"),
    (["--inference.provider", "dynamo", "--inference.dynamo.frontend_url", "http://127.0.0.1:8000",
      "--inference.dynamo.rl_url", "http://127.0.0.1:8001"], r"trainer\.lora with inference\.dynamo\.frontend_url and inference\.dynamo\.rl_url: .* unset "
                                                          r"inference\.dynamo\.frontend_url and inference\.dynamo\.rl_url"),
    (["--inference.provider", "dynamo", "--inference.dynamo.prefill_workers", "1"],
     r"trainer\.lora with inference\.dynamo\.prefill_workers: .* set inference\.dynamo\.prefill_workers = 0"),
])
def test_lora_where_fleetrl_cannot_keep_the_adapter_is_refused_before_anything_starts(flags, message, tmp_path,
                                                                                      capsys):
    assert main(["rl", "--trainer.lora.rank", "8", "--run.dir", str(tmp_path / "run"), *flags, "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert re.search(message, err) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_dynamo_worker_serving_the_adapter_gets_the_native_servers_lora_engine_args(tmp_path):
    from fleetrl.inference.dynamo.launcher import worker_argv
    from fleetrl.inference.vllm.launcher import LaunchedAdapter

    spec = LoraConfig(rank=12, target_modules=["q_proj", "v_proj"]).spec
    config = Config().inference
    argv = worker_argv(tmp_path, config, tmp_path, prefill=False, adapter=spec)
    assert argv[argv.index("--enable-lora"):][:9] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1",
                                                      "--max-cpu-loras", "1", "--lora-target-modules", "q_proj"]
    assert "--enable-lora" not in worker_argv(tmp_path, config, tmp_path, prefill=False)
    assert LaunchedAdapter(spec, tmp_path).argv()[:len(spec.engine_args())] == spec.engine_args()


def test_lora_is_off_by_default_and_a_resume_may_not_change_it():
    lora = Config().trainer.lora
    assert lora.rank == 0 and not lora.enabled and lora.dropout == 0.0 and not lora.use_rslora
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert adapter_config(lora, "base") is None
    assert "trainer.lora" in RUN_DEFINING["rl"] and "trainer.lora" in RUN_DEFINING["sft"]
    config = load_config([], [("trainer.lora.rank", "12"), ("trainer.lora.target_modules", '["q_proj"]')])
    assert "[trainer.lora]" in to_toml(config)  # and it reads back as it was (to_toml checks)


def test_an_adapter_update_replaces_the_whole_adapter_or_nothing(model_dir, tmp_path):
    """What a worker's receiver writes into its adapter folder (fleetrl/lora.py): every tensor of
    the adapter the folder holds, each of its rank; a part of one (an update that ended early)
    or a tensor of another shape is refused before the folder changes."""
    spec = LoraConfig(rank=8, alpha=16).spec
    zeros = zero_adapter(model_dir, spec)
    write_adapter(tmp_path, spec.peft_config(model_dir), zeros.items())
    update = [(name, torch.ones_like(t)) for name, t in zeros.items()]
    spec.check(update, "update")
    check_complete(tmp_path, update, "update")
    with pytest.raises(AdapterError, match=rf"update: {len(update) - 1} tensors received, not the adapter's "
                                           rf"{len(update)} \(missing "):
        check_complete(tmp_path, update[1:], "update")
    with pytest.raises(AdapterError, match="update: 0 tensors received"):
        check_complete(tmp_path, [], "update")
    name, tensor = update[0]
    with pytest.raises(AdapterError, match=f"update: {name} has shape .*, not rank 8"):
        spec.check([(name, torch.ones(4, tensor.shape[1]))], "update")
    with pytest.raises(AdapterError, match="update: model.embed_tokens.weight is no tensor of an adapter"):
        spec.check([("model.embed_tokens.weight", tensor)], "update")


@pytest.mark.parametrize("sizes, targets", [
    ({}, LORA.target_modules),  # the tiny model's: grouped-query attention, head_dim from the hidden size
    ({"head_dim": 12, "num_key_value_heads": 1, "num_hidden_layers": 3}, ["k_proj", "o_proj", "down_proj"]),
])
def test_the_zero_adapter_is_what_peft_makes_of_the_models_config(model_dir, tmp_path, sizes, targets):
    """Shaped from config.json alone (no model built: fleetrl/lora.py), it is peft's adapter on the
    model, name for name (the form peft saves), shape for shape, fp32 as the trainer's."""
    from peft import LoraConfig as PeftLoraConfig
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig.from_pretrained(model_dir)
    for name, value in sizes.items():
        setattr(config, name, value)
    config.save_pretrained(tmp_path)
    spec = LoraConfig(rank=6, alpha=12, target_modules=targets).spec
    model = AutoModelForCausalLM.from_config(config)
    model.add_adapter(PeftLoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets))
    peft_s = {key: (tuple(param.shape), param.dtype) for name, param in model.named_parameters()
              if (key := adapter_key(name))}
    zeros = zero_adapter(tmp_path, spec)
    assert {key: (tuple(t.shape), t.dtype) for key, t in zeros.items()} == peft_s
    assert list(zeros) == list(peft_s) and not any(t.any() for t in zeros.values())


def test_the_zero_adapter_is_written_on_the_control_loops_thread_without_tripping_the_wire(model_dir, tmp_path):
    """The launchers write a worker's zero adapter on the control loop's thread, while the trainer
    may load the model on the main one. Built through transformers' model init, as it was, it set
    torch's default dtype for the whole process there (issue 36, item 1): the tripwire caught it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fleetrl import tripwire
    from fleetrl.lora import held_names, write_zero_adapter

    from .test_tripwire import on_thread

    spec = LoraConfig(rank=8, alpha=16).spec
    with tripwire.armed(True) as wire:
        assert on_thread(lambda: write_zero_adapter(tmp_path, spec, model_dir)) is None
        assert wire.verdict() is None
        def model_init_it_used():
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))

        assert isinstance(on_thread(model_init_it_used), tripwire.TripwireError)
        assert wire.verdict().startswith("tripwire: torch.set_default_dtype called on thread fleetrl-control")
    assert held_names(tmp_path) == set(zero_adapter(model_dir, spec))


def test_a_model_config_without_a_decoders_shapes_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 32, "num_attention_heads": 4,
                                                      "num_hidden_layers": 2}))
    with pytest.raises(AdapterError, match=r"config\.json: intermediate_size is None, not a positive integer"):
        zero_adapter(tmp_path, LORA.spec)


def test_the_max_lora_rank_of_a_worker_is_the_smallest_vllm_takes_at_least_the_rank():
    ranks = (1, 2, 8, 9, 16, 300, 320, 321, 512)
    assert [vllm_max_lora_rank(r) for r in ranks] == [1, 8, 8, 16, 16, 320, 320, 512, 512]
    for bad in (0, 513):
        with pytest.raises(ValueError, match="1 to 512"):
            vllm_max_lora_rank(bad)


def test_the_adapter_config_is_peft_s():
    config = adapter_config(LoraConfig(rank=16, alpha=32, use_rslora=True, target_modules=["q_proj", "v_proj"]),
                            "/models/base")
    assert config == {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "/models/base",
                      "r": 16, "lora_alpha": 32.0, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                      "use_rslora": True, "bias": "none"}


def test_names_map_to_peft_s_saved_form_and_to_plain_hugging_face_names():
    assert adapter_key("model.layers.3.self_attn.q_proj.lora_A.default.weight") == \
        "model.layers.3.self_attn.q_proj.lora_A.weight"
    assert adapter_key("model.layers.3.mlp.down_proj.lora_B.weight") == "model.layers.3.mlp.down_proj.lora_B.weight"
    assert adapter_key("model.layers.3.self_attn.q_proj.base_layer.weight") is None
    assert adapter_key("model.embed_tokens.weight") is None
    assert base_key("model.layers.3.self_attn.q_proj.base_layer.weight") == "model.layers.3.self_attn.q_proj.weight"


# -- one rank ----------------------------------------------------------------------------------


def test_a_fresh_adapter_computes_the_base_models_logits_exactly(model_dir):
    assert torch.equal(logits(lora_policy(model_dir)), logits(load_policy(model_dir, CPU)))


def test_only_the_adapter_trains_and_the_optimizer_state_is_its_alone(model_dir):
    model, optimizer, _ = trained_lora(model_dir, steps=1)
    adapter = {id(param) for _, param in adapter_params(model)}
    assert {id(param) for param in model.parameters() if param.requires_grad} == adapter
    assert {id(param) for param in optimizer.state} == adapter
    # The base is the base model's, under its plain names, every one of them.
    plain = dict(load_policy(model_dir, CPU).named_parameters())
    base = dict(base_params(model))
    assert base.keys() == plain.keys()
    assert all(torch.equal(base[name], plain[name]) for name in plain)


def test_the_published_tensors_are_peft_s_adapter_state_dict(model_dir):
    from peft import get_peft_model_state_dict

    model, _, _ = trained_lora(model_dir, steps=1)
    published = dict(named_tensors(model))
    expected = get_peft_model_state_dict(model)
    assert list(published) == list(expected) and len(published) == 2 * 7 * 2  # A and B, 7 linears, 2 layers
    assert all(torch.equal(published[name], expected[name]) for name in expected)
    assert any(name.endswith("lora_B.weight") and published[name].any() for name in published)  # trained
    assert [name for name, _ in local_shards(model)] == list(published)


def test_attached_workers_start_from_the_adapter_alone(model_dir):
    """An attached worker serves the base model from its own folder; the start weights the fleet
    holds it to are the adapter's (the agreement probe checks the two together)."""
    model = lora_policy(model_dir)
    handed = {}
    hooks = Hooks(wait_batch=lambda step: None, start_weights=lambda version, weights, *_: handed.update(weights))
    world = distributed.World(rank=0, world_size=1, device=CPU)
    loop.hand_start_weights(model, world, 0, agreement_probe(model), hooks)
    assert handed.keys() == dict(named_tensors(model)).keys()
    assert all(adapter_key(name) == name for name in handed)


LOSS_MENU = [
    LossConfig(),
    LossConfig(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
    LossConfig(tis_level="sequence"),
    LossConfig(mis_low=0.5, mis_high=5.0, mis_level="token", clip_low=1.0, clip_high=float("inf"),
               tis_cap=float("inf")),
    LossConfig(mis_low=0.5, mis_level="sequence"),
    LossConfig(mis_low=0.5, mis_level="geometric"),
    LossConfig(kl_coef=0.1),
]


@pytest.mark.parametrize("loss", LOSS_MENU, ids=lambda loss: ",".join(
    f"{name}={value}" for name, value in loss.model_dump(exclude_defaults=True).items()) or "default")
def test_every_loss_option_trains_the_adapter_alone(model_dir, loss):
    """Two steps, the second scoring tokens one version behind under their own version (the k
    bound's `previous` weights) and, with kl_coef, under the reference (the fresh adapter)."""
    cfg = replace(FAST, loss=loss)
    model = lora_policy(model_dir)
    optimizer = build_optimizer(model, cfg)
    base = {name: param.detach().clone() for name, param in base_params(model)}
    reference = KeptWeights()
    reference.remember(model, 0)
    previous = KeptWeights()
    first = train_step(model, optimizer, make_batch(model, noise=0.2), cfg, previous, reference)
    # At v0 the adapter adds nothing: the reference is the base model exactly.
    assert first.ref_kl == 0.0
    behind = make_batch(model, seed=1, step=2, noise=0.2)
    for sample in behind.samples:
        sample.spans = [VersionSpan(0, 0)]  # sampled at v0, one version behind the trainer's v1
    second = train_step(model, optimizer, behind, cfg, previous, reference)
    assert second.mismatch_tokens > 0
    for metrics in (first, second):
        assert not metrics.skipped and torch.isfinite(torch.tensor([metrics.loss, metrics.grad_norm])).all()
    assert all(torch.equal(param, base[name]) for name, param in base_params(model))
    assert all(tensor.any() for name, tensor in named_tensors(model) if name.endswith("lora_B.weight"))


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_alone_and_resumes_exactly(model_dir, tmp_path):
    model, optimizer, batch = trained_lora(model_dir)
    adapter = adapter_config(LORA, model_dir)
    folder = checkpoint.save(tmp_path, 2, model, optimizer, keep=1, adapter=adapter)
    assert checkpoint.adapter_of(folder) == adapter
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    model_keys = {key.removeprefix("model.") for key in stored if key.startswith("model.")}
    assert model_keys and all(".lora_" in key for key in model_keys)

    restored = lora_policy(model_dir)
    restored_optimizer = build_optimizer(restored, FAST)
    assert checkpoint.load(tmp_path, restored, restored_optimizer) == 2
    train_step(model, optimizer, batch, FAST)
    train_step(restored, restored_optimizer, batch, FAST)
    for (name, want), (_, got) in zip(named_tensors(model), named_tensors(restored), strict=True):
        assert torch.equal(got, want), name


def test_a_checkpoint_of_other_weights_is_refused_in_one_line(model_dir, tmp_path):
    model, optimizer, _ = trained_lora(model_dir, steps=1)
    checkpoint.save(tmp_path, 1, model, optimizer, keep=1, adapter=adapter_config(LORA, model_dir))
    full = load_policy(model_dir, CPU)
    with pytest.raises(FleetrlError, match=r"holds no model\.embed_tokens\.weight .*another trainer\.lora"):
        checkpoint.load(tmp_path, full, build_optimizer(full, FAST))
    with pytest.raises(ValueError, match="adapter's config"):
        checkpoint.save(tmp_path, 2, model, optimizer, keep=1)


def run_with_config(model_dir, run_dir, lora: LoraConfig) -> None:
    run_dir.mkdir()
    config = Config(model=ModelConfig(path=model_dir))
    config.trainer.lora = lora
    (run_dir / "config.toml").write_text(to_toml(config))


def test_the_merged_export_and_the_adapter_folder_compute_the_adapters_logits(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, optimizer, _ = trained_lora(model_dir)
    want = logits(model)
    run = tmp_path / "run"
    run_with_config(model_dir, run, LORA)
    checkpoint.save(run / "checkpoints", 2, model, optimizer, keep=1, adapter=adapter_config(LORA, model_dir))

    assert main(["export", str(run), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name or "base_layer" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), want, rtol=1e-5, atol=1e-5)

    assert main(["export", str(run), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert {path.name for path in (tmp_path / "adapter").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "fleetrl_version.json"}
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter")
    torch.testing.assert_close(logits(with_peft), want, rtol=1e-5, atol=1e-5)

    # The run's final model, from the adapter it published last: the same merged model.
    export_weights(model_dir, named_tensors(model), tmp_path / "final", 2, adapter=adapter_config(LORA, model_dir))
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "final")), want,
                               rtol=1e-5, atol=1e-5)


def test_export_adapter_is_refused_for_a_run_without_lora(model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run_with_config(model_dir, run, LoraConfig())
    assert main(["export", str(run), str(tmp_path / "out"), "--adapter"]) == 1
    assert "fleetrl export --adapter: " in capsys.readouterr().err
    full = load_policy(model_dir, CPU)
    folder = checkpoint.save(tmp_path / "checkpoints", 1, full, build_optimizer(full, FAST), keep=1)
    with pytest.raises(FleetrlError, match="holds all the weights, no LoRA adapter"):
        export_hf(model_dir, folder, tmp_path / "out", version=1, adapter_only=True)
    assert not (tmp_path / "out").exists()


# -- two ranks ---------------------------------------------------------------------------------


def _one_step(model_dir, world):
    """A LoRA policy (sharded on two ranks) after one step on a batch the base model sampled,
    with what it publishes before and after, on every rank."""
    from peft import get_peft_model_state_dict

    batch = make_batch(load_policy(model_dir, CPU, sharded=False), noise=0.2)
    model = lora_policy(model_dir)
    before = {name: tensor.clone() for name, tensor in named_tensors(model)}  # unsharded: the parameters
    peft_state = {name: tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.clone()
                  for name, tensor in get_peft_model_state_dict(model).items()}
    optimizer = build_optimizer(model, FAST)
    train_step(model, optimizer, batch, FAST)
    gathered = {}

    def publish(version, gather, probe_ids, reference):
        gathered.update((name, tensor.clone()) for name, tensor in gather.tensors())

    hooks = Hooks(wait_batch=lambda step: None, publish=publish if world.rank == 0 else None)
    loop.publish_streamed(1, model, world, agreement_probe(model), hooks)
    after = {name: tensor.clone() for name, tensor in named_tensors(model)}
    return {"before": before, "peft": peft_state, "after": after, "gathered": gathered}, model, optimizer


def _rank_main(rank, model_dir, out_dir):
    world = distributed.init(timeout_s=60)  # joined already (tests/ranks.py)
    result, model, optimizer = _one_step(model_dir, world)
    # A checkpoint of the sharded adapter, loaded into a fresh sharded one.
    checkpoint.save(out_dir / "checkpoints", 1, model, optimizer, keep=1, adapter=adapter_config(LORA, model_dir))
    resumed = lora_policy(model_dir)
    checkpoint.load(out_dir / "checkpoints", resumed, build_optimizer(resumed, FAST))
    result["resumed"] = dict(named_tensors(resumed))
    torch.save(result, out_dir / f"lora_rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("lora-ranks")
    spawn_ranks(_rank_main, 2, out_dir, model_dir, out_dir, timeout_s=180)
    return [torch.load(out_dir / f"lora_rank{rank}.pt") for rank in (0, 1)]


def test_two_ranks_publish_peft_s_adapter_alike_step_as_one_rank_and_resume_exactly(model_dir, two_ranks):
    one, _, _ = _one_step(model_dir, distributed.World(rank=0, world_size=1, device=CPU))
    rank0, rank1 = two_ranks
    for key in ("before", "after"):
        assert list(rank0[key]) == list(rank1[key]) == list(one[key])
        assert all(torch.equal(rank0[key][name], rank1[key][name]) for name in one[key])
    # Sharded, the adapter starts as unsharded, and peft reads it so too.
    assert all(torch.equal(rank0["before"][name], one["before"][name]) for name in one["before"])
    assert all(torch.equal(rank0["peft"][name], one["before"][name]) for name in one["before"])
    # The gather session of a publish streams exactly the adapter (on the GPU path).
    assert list(rank0["gathered"]) == list(one["after"])
    assert all(torch.equal(rank0["gathered"][name], rank0["after"][name]) for name in one["after"])
    # The sharded step sums the ranks' gradients in another order: equal up to rounding.
    for name, want in one["after"].items():
        torch.testing.assert_close(rank0["after"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(one["after"][name], one["before"][name]) for name in one["after"])
    assert all(torch.equal(rank0["resumed"][name], rank0["after"][name]) for name in one["after"])


def test_a_lora_worker_is_started_to_serve_the_adapters_layers_alone(tmp_path):
    """The launch command of a LoRA run's vLLM server: the adapter served as policy-lora from its
    folder, vLLM's smallest rank that holds it, and LoRA on the adapter's layers alone (vLLM would
    wrap the LM head too, whose CPU LoRA logits fail on a batch that mixes the agreement probe's
    prompt logprobs with sampling: test_rl_e2e.py shows the flag is what serves such a batch)."""
    from fleetrl.config import InferenceConfig
    from fleetrl.inference.vllm.launcher import LaunchedAdapter, server_argv, server_env

    adapter = LaunchedAdapter(LoraConfig(rank=12, alpha=24, target_modules=["q_proj", "v_proj"]).spec, tmp_path)
    argv = server_argv(tmp_path / "model", InferenceConfig(), 8000, adapter)

    def after(flag: str, count: int = 1) -> list[str]:
        return argv[argv.index(flag) + 1:argv.index(flag) + 1 + count]

    assert "--enable-lora" in argv and after("--max-lora-rank") == ["16"] and after("--max-loras") == ["1"]
    assert after("--lora-target-modules", 3) == ["q_proj", "v_proj", "--lora-modules"]
    assert json.loads(after("--lora-modules")[0]) == {"name": "policy-lora", "path": str(tmp_path)}
    assert server_env(InferenceConfig(), 0, 8000, "admin", "data", adapter)["FLEETRL_ADAPTER_DIR"] == str(tmp_path)
