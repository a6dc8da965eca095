"""`fleetrl export`: a run's checkpoint as a Hugging Face folder (tiny random Llama, CPU)."""

import pytest
import torch

from fleetrl.cli import main
from fleetrl.errors import FleetrlError
from fleetrl.config import Config, ModelConfig, to_toml
from fleetrl.trainer import checkpoint
from fleetrl.trainer.model import agreement_probe, load_policy, prompt_logprobs
from fleetrl.trainer.step import build_optimizer, train_step
from tests.unit.test_trainer_step import CPU, FAST, make_batch, save_tiny_model, save_tiny_tokenizer, weights


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama of the trainer tests, with a tokenizer, as any base model folder has."""
    path = tmp_path_factory.mktemp("tiny-llama-with-tokenizer")
    save_tiny_model(path)
    save_tiny_tokenizer(path)
    return path


def trained_run(model_dir, run_dir, steps=(1, 2)):
    """A run directory with its config and a checkpoint after each of `steps`; the model."""
    (run_dir).mkdir()
    (run_dir / "config.toml").write_text(to_toml(Config(model=ModelConfig(path=model_dir))))
    model = load_policy(model_dir, CPU)
    optimizer = build_optimizer(model, FAST)
    for step in steps:
        train_step(model, optimizer, make_batch(model, seed=step, noise=0.2), FAST)
        checkpoint.save(run_dir / "checkpoints", step, model, optimizer, keep=5)
    return model


def test_the_exported_folder_loads_in_transformers_with_the_trainers_logprobs(model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = trained_run(model_dir, tmp_path / "run")
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert "step 2 of" in capsys.readouterr().out  # the newest complete checkpoint
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert exported.config.use_cache  # as the base model had it, not as training set it
    for name, tensor in weights(trained).items():
        assert torch.equal(dict(exported.named_parameters())[name].detach(), tensor), name
    probe = agreement_probe(trained)
    assert prompt_logprobs(exported, probe, CPU) == prompt_logprobs(trained.eval(), probe, CPU)
    assert AutoTokenizer.from_pretrained(out)("w5 w7")["input_ids"] == [5, 7]


def test_export_of_a_given_step_and_what_it_refuses(model_dir, tmp_path, capsys):
    trained_run(model_dir, tmp_path / "run", steps=(1, 2))
    run = str(tmp_path / "run")
    assert main(["export", run, str(tmp_path / "step1"), "--step", "1"]) == 0
    one = load_policy(tmp_path / "step1", CPU)
    two = load_policy(model_dir, CPU)
    checkpoint.load_weights(tmp_path / "run" / "checkpoints" / "step_000002", two)
    assert any(not torch.equal(a, weights(two)[n]) for n, a in weights(one).items())  # step 1's, not 2's
    capsys.readouterr()

    assert main(["export", run, str(tmp_path / "step1"), "--step", "1"]) == 1
    assert "step1 exists: export writes a new folder" in capsys.readouterr().err
    assert main(["export", run, str(tmp_path / "x"), "--step", "7"]) == 1
    assert capsys.readouterr().err.strip().endswith("no checkpoint of step 7 in "
                                                    f"{tmp_path / 'run' / 'checkpoints'} (steps checkpointed: 1, 2)")
    assert main(["export", run]) == 1
    assert "fleetrl export needs a run directory and a folder to write" in capsys.readouterr().err
    assert main(["export", str(tmp_path), str(tmp_path / "y")]) == 1
    assert "no config.toml (not a run directory)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_final_weights_export_like_their_checkpoint(model_dir, tmp_path):
    """Every run's final_model comes from the weights it published last (no checkpoint needed):
    the same folder as the export of a checkpoint of those weights."""
    from safetensors.torch import load_file

    from fleetrl.trainer.export import export_weights, folder_version

    trained = trained_run(model_dir, tmp_path / "run", steps=(1,))
    export_weights(model_dir, weights(trained).items(), tmp_path / "final", version=1)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "ckpt")]) == 0
    assert folder_version(tmp_path / "final") == folder_version(tmp_path / "ckpt") == 1  # what `fleetrl eval` labels
    final, ckpt = (load_file(tmp_path / name / "model.safetensors") for name in ("final", "ckpt"))
    assert final.keys() == ckpt.keys() and all(torch.equal(final[n], ckpt[n]) for n in final)
    for name in ("config.json", "tokenizer.json"):
        assert (tmp_path / "final" / name).read_bytes() == (tmp_path / "ckpt" / name).read_bytes()
    with pytest.raises(FleetrlError, match="no weight given for"):
        export_weights(model_dir, list(weights(trained).items())[1:], tmp_path / "partial", version=1)
    assert not (tmp_path / "partial").exists()
