"""The on-disk format of one published version: safetensors shards + manifest + READY.

    storage_dir/v{version}/
        shard-00000.safetensors ...  tensors in send order, at most ~shard_bytes each
        manifest.json                version, fleetrl checksum, and per shard: file, size,
                                     sha256 and the (name, dtype, shape) of every tensor
        READY                        sha256 of manifest.json, written last
        WRITTEN_BY_FLEETRL           marks the folder as fleetrl's, written first

Errors name files relative to storage_dir ("v3/READY"): vLLM blanks absolute paths out of
the HTTP error a failed worker call returns (the worker's log has them in full).

A version is built in a scratch folder and renamed into place; READY is written after the
rename. A reader trusts nothing without READY, and nothing whose READY, manifest or shard
hashes disagree, so a half-written or corrupted version is refused before anything loads.
One process (trainer rank 0) writes into a storage folder. The storage folder may be shared with
other things (inference.weights.dir), so fleetrl deletes or replaces only folders holding its
WRITTEN_BY_FLEETRL marker: a `v3/` of anyone else's is never touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fleetrl.errors import FleetrlError
from fleetrl.files import atomic_write, fsync_dir, sha256_file
from fleetrl.weights.buckets import TensorMeta, iter_buckets
from fleetrl.weights.checksum import WeightsHasher

FORMAT = "fleetrl-weights/1"
MANIFEST = "manifest.json"
READY = "READY"
MARKER = "WRITTEN_BY_FLEETRL"


class ManifestError(FleetrlError):
    """A published version that must not be loaded; the message names the file at fault."""


@dataclass(frozen=True)
class Shard:
    file: str
    size: int
    sha256: str
    tensors: list[TensorMeta]


@dataclass(frozen=True)
class Manifest:
    folder: Path
    version: int
    checksum: str
    shards: list[Shard]


def version_dir(storage_dir: Path, version: int) -> Path:
    return storage_dir / f"v{version}"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_version(storage_dir: Path, version: int, named: Iterable[tuple[str, torch.Tensor]],
                  shard_bytes: int) -> Manifest:
    """Writes one version (see the module doc) and returns its manifest."""
    storage_dir.mkdir(parents=True, exist_ok=True)
    target = version_dir(storage_dir, version)
    scratch = _scratch_dir(storage_dir, version)
    _remove_ours(scratch)  # a killed writer's
    scratch.mkdir()
    (scratch / MARKER).write_text(FORMAT)  # first: a killed writer's scratch is recognisably ours too
    hasher = WeightsHasher()
    shards = []
    try:
        # Each tensor goes to host memory as it comes: gathered from a CUDA trainer's shards one
        # at a time, the GPU never holds a shard's worth of them.
        on_host = ((name, tensor.detach().to("cpu").contiguous()) for name, tensor in named)
        for index, cpu in enumerate(iter_buckets(on_host, shard_bytes)):
            for name, tensor in cpu:
                hasher.update(name, tensor)
            path = scratch / f"shard-{index:05d}.safetensors"
            save_file(dict(cpu), str(path))
            path.chmod(0o644)  # safetensors creates 0600; workers may run as another user
            _fsync_file(path)
            shards.append(Shard(path.name, path.stat().st_size, sha256_file(path),
                                [TensorMeta.of(name, tensor) for name, tensor in cpu]))
        manifest = Manifest(target, version, hasher.hexdigest(), shards)
        manifest_bytes = json.dumps(_to_json(manifest), indent=1).encode()
        atomic_write(scratch / MANIFEST, manifest_bytes, durable=True)
        # An earlier attempt at this version (a failed or retried publish) is replaced.
        _remove_ours(target)
        os.rename(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    atomic_write(target / READY, hashlib.sha256(manifest_bytes).hexdigest().encode(), durable=True)
    fsync_dir(target)
    return manifest


def _scratch_dir(storage_dir: Path, version: int) -> Path:
    return storage_dir / f".v{version}.tmp"


def _ours(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _remove_ours(folder: Path) -> None:
    """Delete `folder` (if there is one) when fleetrl wrote it; refuse when someone else did."""
    if not folder.exists():
        return
    if not _ours(folder):
        raise ManifestError(f"{folder} was not written by fleetrl (it holds no {MARKER}), so fleetrl will not "
                            f"replace it; give inference.weights.dir a folder of fleetrl's own")
    shutil.rmtree(folder)


def _to_json(manifest: Manifest) -> dict:
    return {
        "format": FORMAT,
        "version": manifest.version,
        "checksum": manifest.checksum,
        "shards": [
            {"file": s.file, "size": s.size, "sha256": s.sha256,
             "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in s.tensors]}
            for s in manifest.shards
        ],
    }


def read_manifest(manifest_path: Path) -> Manifest:
    """Parses and fully verifies a published version; raises ManifestError on any doubt.

    Checks, in order: READY exists and holds the manifest's sha256; the manifest parses;
    every shard has its size and sha256; every shard's own header lists exactly the
    manifest's tensors with their dtypes and shapes.
    """
    folder = manifest_path.parent
    ready = folder / READY
    if not ready.is_file():
        raise ManifestError(f"{_rel(ready)} is missing: the version is incomplete or still being written")
    try:
        manifest_bytes = manifest_path.read_bytes()
    except OSError as e:
        raise ManifestError(f"{_rel(manifest_path)}: cannot read ({e.strerror})") from None
    if ready.read_text().strip() != hashlib.sha256(manifest_bytes).hexdigest():
        raise ManifestError(f"{_rel(manifest_path)}: sha256 differs from the one recorded in {READY}")
    manifest = _from_json(folder, manifest_path, manifest_bytes)
    for shard in manifest.shards:
        _verify_shard(folder / shard.file, shard)
    return manifest


def _rel(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def _from_json(folder: Path, manifest_path: Path, data: bytes) -> Manifest:
    try:
        raw = json.loads(data)
        if raw["format"] != FORMAT:
            raise ManifestError(f"{_rel(manifest_path)}: format {raw['format']!r}, expected {FORMAT!r}")
        shards = [
            Shard(s["file"], int(s["size"]), s["sha256"],
                  [TensorMeta(t["name"], t["dtype"], tuple(t["shape"])) for t in s["tensors"]])
            for s in raw["shards"]
        ]
        return Manifest(folder, int(raw["version"]), raw["checksum"], shards)
    except (ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{_rel(manifest_path)}: malformed ({type(e).__name__}: {e})") from None


def _verify_shard(path: Path, shard: Shard) -> None:
    where = _rel(path)
    if Path(shard.file).name != shard.file:
        raise ManifestError(f"{where}: shard names must be plain file names")
    if not path.is_file():
        raise ManifestError(f"{where}: shard is missing")
    if path.stat().st_size != shard.size:
        raise ManifestError(f"{where}: size {path.stat().st_size}, manifest says {shard.size}")
    if sha256_file(path) != shard.sha256:
        raise ManifestError(f"{where}: sha256 differs from the manifest (corrupted shard)")
    with safe_open(str(path), framework="pt") as f:
        if set(f.keys()) != {t.name for t in shard.tensors}:
            raise ManifestError(f"{where}: holds tensors {sorted(f.keys())}, manifest lists others")
        for meta in shard.tensors:
            found = f.get_slice(meta.name)
            found_meta = TensorMeta(meta.name, _safetensors_dtype(found.get_dtype()), tuple(found.get_shape()))
            if found_meta != meta:
                raise ManifestError(f"{where}: tensor {meta.name} is {found_meta.dtype}{list(found_meta.shape)}, "
                                    f"manifest says {meta.dtype}{list(meta.shape)}")


# safetensors spells dtypes its own way ("BF16"); the manifest uses torch's ("bfloat16").
_SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


def _safetensors_dtype(name: str) -> str:
    return _SAFETENSORS_DTYPES.get(name, name)


def iter_tensors(manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a verified manifest, one at a time, in send order."""
    for shard in manifest.shards:
        with safe_open(str(manifest.folder / shard.file), framework="pt") as f:
            for meta in shard.tensors:
                yield meta.name, f.get_tensor(meta.name)


def collect_garbage(storage_dir: Path, keep: int) -> list[Path]:
    """Removes all but the `keep` newest versions, and scratch folders a killed writer left
    behind, of those fleetrl wrote (marked); returns what it removed. Call it between writes
    (there is a single writer)."""
    versions = sorted((int(p.name[1:]), p) for p in storage_dir.glob("v*") if p.name[1:].isdigit() and _ours(p))
    doomed = [p for _, p in versions[:max(len(versions) - keep, 0)]]
    doomed += sorted(p for p in storage_dir.glob(".v*.tmp") if _ours(p))
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed
