"""Weight-transfer formats and the broadcast group, without vLLM: checksum, bucket layout,
manifest writing/verification, a real two-process gloo broadcast, and each transport's sender
against its receiver in a second process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from fleetrl.weights import WeightsHasher
from fleetrl.weights.broadcast import group as broadcast_group
from fleetrl.weights.buckets import ALIGN, TensorMeta, iter_buckets, layout, packed_buckets, unpack_bucket
from fleetrl.weights.filesystem.manifest import (
    MANIFEST,
    MARKER,
    READY,
    ManifestError,
    collect_garbage,
    iter_tensors,
    read_manifest,
    version_dir,
    write_version,
)
from fleetrl.transports import TRANSPORTS, spec
from fleetrl.weights.broadcast.wire import BroadcastInit, BucketInfo
from fleetrl.weights.filesystem.wire import FilesystemInit, ManifestInfo
from fleetrl.weights.wire import parse_init, parse_update


def sample_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(5, generator=g)),
        ("scale", torch.tensor(3.5, dtype=torch.float16)),  # 0-d, 2 bytes: forces padding
        ("model.layers.0.mlp.up_proj.weight", torch.randn(3, 5, generator=g)),
        ("counts", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ]


def pack_bucket(named, device=torch.device("cpu")):
    """All of `named` in one bucket."""
    (packed,) = packed_buckets(named, 1 << 20, device)
    return packed


def digest(named) -> str:
    hasher = WeightsHasher()
    for name, tensor in named:
        hasher.update(name, tensor)
    return hasher.hexdigest()


# -- checksum ---------------------------------------------------------------------------------


def test_checksum_is_deterministic_and_layout_independent():
    named = sample_tensors()
    # A transposed-then-contiguous copy has other strides but the same logical bytes.
    strided = [(n, t.t().contiguous().t() if t.dim() == 2 else t.clone()) for n, t in named]
    assert digest(named) == digest(named) == digest(strided)


@pytest.mark.parametrize("change", ["name", "dtype", "shape", "value", "order"])
def test_checksum_sees_every_difference(change):
    named = sample_tensors()
    other = list(named)
    name, tensor = other[1]
    if change == "name":
        other[1] = (name + "x", tensor)
    elif change == "dtype":
        other[1] = (name, tensor.to(torch.float64).to(torch.float32).view(torch.int32))
    elif change == "shape":
        other[1] = (name, tensor.reshape(1, -1))
    elif change == "value":
        bumped = tensor.clone()
        bumped[0] += 1
        other[1] = (name, bumped)
    else:
        other[0], other[1] = other[1], other[0]
    assert digest(other) != digest(named)


# -- buckets ----------------------------------------------------------------------------------


def test_bucket_round_trip_is_bit_exact():
    named = sample_tensors()
    buffer, metas = pack_bucket(named)
    offsets, total = layout(metas)
    assert buffer.dtype == torch.uint8 and buffer.numel() == total
    assert all(offset % ALIGN == 0 for offset in offsets)
    unpacked = unpack_bucket(buffer, metas)
    assert [n for n, _ in unpacked] == [n for n, _ in named]
    for (_, sent), (_, got) in zip(named, unpacked):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.view(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))
    assert digest(unpacked) == digest(named)


def test_unpack_bucket_refuses_metadata_of_another_size():
    buffer, metas = pack_bucket(sample_tensors())
    with pytest.raises(ValueError, match="metadata describes"):
        unpack_bucket(buffer, metas[:-1])


# -- wire schema -------------------------------------------------------------------------------


def test_wire_infos_survive_json_with_the_keys_the_receiver_reads():
    init = BroadcastInit(master_address="10.0.0.1", master_port=29500, group_name="g", backend="gloo",
                         rank_offset=3, world_size=5, timeout_s=60.0, target="adapter")
    sent = json.loads(json.dumps(init.to_dict()))
    assert sent == {"transport": "broadcast", "master_address": "10.0.0.1", "master_port": 29500, "group_name": "g",
                    "backend": "gloo", "rank_offset": 3, "world_size": 5, "timeout_s": 60.0, "target": "adapter"}
    assert parse_init(sent) == init
    assert FilesystemInit().to_dict() == {"transport": "filesystem", "target": "model"}
    assert parse_init(FilesystemInit(target="adapter").to_dict()) == FilesystemInit(target="adapter")
    _, metas = pack_bucket(sample_tensors())
    bucket = parse_update("broadcast", json.loads(json.dumps(BucketInfo.of(metas).to_dict())))
    assert bucket.metas() == metas
    manifest = ManifestInfo(manifest="/w/v3/manifest.json")
    assert parse_update("filesystem", manifest.to_dict()) == manifest


@pytest.mark.parametrize("bad, match", [
    ({"transport": "carrier-pigeon"}, "not one of"),
    ({"transport": "broadcast", "master_address": "h"}, "needs master_address"),
    ({"transport": "filesystem", "colour": "red"}, "^init_info: not a FilesystemInit: unknown colour$"),
    ({"transport": "filesystem", "target": "optimizer"},
     "init_info: .*target is 'optimizer', not 'model' or 'adapter'"),
    ({"transport": "broadcast", "master_address": "h", "master_port": "29500", "group_name": "g", "world_size": 2},
     "init_info: not a BroadcastInit: master_port is '29500', not a valid integer"),
])
def test_wire_init_info_refuses_what_the_receiver_cannot_use(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_init(bad)


def test_buckets_respect_the_size_limit_in_order():
    named = [(f"t{i}", torch.zeros(100, dtype=torch.uint8)) for i in range(10)]  # 112 B aligned
    buckets = list(iter_buckets(named, bucket_bytes=300))
    assert [len(b) for b in buckets] == [2, 2, 2, 2, 2]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    big = [("small", torch.zeros(10)), ("big", torch.zeros(1000)), ("tail", torch.zeros(10))]
    assert [[n for n, _ in b] for b in iter_buckets(big, bucket_bytes=100)] == [["small"], ["big"], ["tail"]]


def test_packed_buckets_group_like_iter_buckets_and_round_trip_bit_exact():
    named = [(f"{i}.{n}", t) for i, (n, t) in enumerate(sample_tensors() * 4)]
    named.insert(5, ("oversize", torch.arange(100, dtype=torch.float32)))  # 400 B > the 128 B limit
    packed = list(packed_buckets(named, 128, torch.device("cpu")))
    assert [[m.name for m in metas] for _, metas in packed] == \
        [[n for n, _ in bucket] for bucket in iter_buckets(named, 128)]
    assert ["oversize"] in [[m.name for m in metas] for _, metas in packed]  # alone in its own
    for buffer, metas in packed:
        assert buffer.numel() == layout(metas)[1]  # exactly what the receiver allocates
        assert buffer.numel() <= 128 or len(metas) == 1
    received = [pair for buffer, metas in packed for pair in unpack_bucket(buffer, metas)]
    assert digest(received) == digest(named)


def test_packed_buckets_hold_one_source_tensor_at_a_time():
    """Packed as they come, the tensors of a stream (each gathered from the shards on the
    trainer's GPU, say) are let go once copied: never more than the one in hand is alive, and
    a bucket handed out is not kept by the packer."""
    import weakref

    alive, peak = set(), [0]

    def fresh(i: int) -> torch.Tensor:
        tensor = torch.full((10 + i % 7,), float(i))
        alive.add(i)
        weakref.finalize(tensor, alive.discard, i)
        peak[0] = max(peak[0], len(alive))
        return tensor

    def stream():
        for i in range(40):
            yield f"t{i}", fresh(i)  # no name bound to it here: the consumer holds the only reference

    buckets = weakref.WeakSet()
    sizes = []
    for buffer, metas in packed_buckets(stream(), 200, torch.device("cpu")):
        assert len(alive) <= 1
        sizes.append(buffer.numel())
        buckets.add(buffer)
        del buffer
        assert len(buckets) == 0  # the packer kept no reference to it
    assert peak[0] == 1
    assert len(sizes) > 3 and max(sizes) <= 200


def test_broadcast_backend_is_automatic_and_overridable(monkeypatch):
    from fleetrl.config import load_config
    from fleetrl.errors import FleetrlError
    from fleetrl.weights.broadcast.sender import BroadcastTransport

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert load_config([], []).inference.weights.backend == "auto"
    assert broadcast_group.choose_backend("auto", cpu) == "gloo"
    assert broadcast_group.choose_backend("auto", cuda) == "nccl"
    assert broadcast_group.choose_backend("gloo", cuda) == "gloo"  # staged through host memory
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FleetrlError, match="backend = nccl needs a CUDA device"):
        broadcast_group.choose_backend("nccl", cpu)
    with pytest.raises(FleetrlError, match="backend = nccl needs a CUDA device"):
        BroadcastTransport("127.0.0.1", 1 << 20, 60.0, backend="nccl")  # refused before any worker joins
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert broadcast_group.choose_backend("nccl", cpu) == "nccl"  # staged through the trainer's GPU
    assert load_config([], [("inference.weights.backend", "nccl")]).inference.weights.backend == "nccl"


def test_tensor_meta_rejects_unknown_dtypes():
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        TensorMeta("x", "float128", (1,)).nbytes


# -- manifest ---------------------------------------------------------------------------------


def written(tmp_path: Path, version: int = 3):
    named = sample_tensors()
    manifest = write_version(tmp_path, version, iter(named), shard_bytes=64)
    return named, manifest, manifest.folder / MANIFEST


def test_manifest_round_trip(tmp_path):
    named, manifest, path = written(tmp_path)
    assert manifest.folder == version_dir(tmp_path, 3)
    assert len(manifest.shards) > 1  # 64-byte shards split the sample
    assert (manifest.folder / READY).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3"]  # no scratch left behind
    verified = read_manifest(path)
    assert verified.checksum == manifest.checksum == digest(named)
    loaded = list(iter_tensors(verified))
    assert [n for n, _ in loaded] == [n for n, _ in named]
    assert digest(loaded) == digest(named)


def test_manifest_without_ready_marker_is_refused(tmp_path):
    _, manifest, path = written(tmp_path)
    (manifest.folder / READY).unlink()
    with pytest.raises(ManifestError, match="v3/READY is missing"):
        read_manifest(path)


def test_corrupt_shard_is_refused(tmp_path):
    _, manifest, path = written(tmp_path)
    shard = manifest.folder / manifest.shards[1].file
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, one flipped bit in the tensor bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=f"v3/{shard.name}: sha256 differs"):
        read_manifest(path)


def test_missing_shard_is_refused(tmp_path):
    _, manifest, path = written(tmp_path)
    (manifest.folder / manifest.shards[0].file).unlink()
    with pytest.raises(ManifestError, match="shard is missing"):
        read_manifest(path)


def test_edited_manifest_is_refused(tmp_path):
    _, _, path = written(tmp_path)
    raw = json.loads(path.read_text())
    raw["shards"][0]["tensors"][0]["shape"] = [5, 7]
    path.write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="differs from the one recorded in"):
        read_manifest(path)


def test_manifest_disagreeing_with_shard_header_is_refused(tmp_path):
    """A manifest rewritten consistently (READY updated too) still has to match the shards."""
    import hashlib

    _, manifest, path = written(tmp_path)
    raw = json.loads(path.read_text())
    raw["shards"][0]["tensors"][0]["dtype"] = "float16"
    data = json.dumps(raw).encode()
    path.write_bytes(data)
    (manifest.folder / READY).write_text(hashlib.sha256(data).hexdigest())
    with pytest.raises(ManifestError, match="manifest says float16"):
        read_manifest(path)


def test_garbage_collection_keeps_the_newest_versions(tmp_path):
    for version in (1, 2, 3, 10):
        write_version(tmp_path, version, iter(sample_tensors()), shard_bytes=1 << 20)
    (tmp_path / ".v11.tmp").mkdir()  # a writer killed mid-write, after its first file
    (tmp_path / ".v11.tmp" / MARKER).write_text("fleetrl-weights/1")
    collect_garbage(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v10", "v3"]


def test_folders_fleetrl_did_not_write_are_never_deleted(tmp_path):
    """A weights dir shared with other things: someone's own v3/ (and v99/, .v6.tmp/) stay, and
    do not count among the versions kept."""
    for name in ("v3", "v99", ".v6.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "theirs.bin").write_bytes(b"keep me")
    for version in (1, 2, 4, 5):
        write_version(tmp_path, version, iter(sample_tensors()), shard_bytes=1 << 20)
    assert all((version_dir(tmp_path, v) / MARKER).is_file() for v in (1, 2, 4, 5))
    assert collect_garbage(tmp_path, keep=2) == [tmp_path / "v1", tmp_path / "v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".v6.tmp", "v3", "v4", "v5", "v99"]
    assert (tmp_path / "v3" / "theirs.bin").read_bytes() == b"keep me"
    with pytest.raises(ManifestError, match=rf"^{tmp_path / 'v3'} was not written by fleetrl \(it holds no "
                                            rf"{MARKER}\), so fleetrl will not replace it"):
        write_version(tmp_path, 3, iter(sample_tensors()), shard_bytes=1 << 20)
    assert sorted(p.name for p in (tmp_path / "v3").iterdir()) == ["theirs.bin"]


def test_rewriting_a_version_replaces_it(tmp_path):
    write_version(tmp_path, 4, iter(sample_tensors()), shard_bytes=1 << 20)
    other = [("only", torch.ones(3))]
    manifest = write_version(tmp_path, 4, iter(other), shard_bytes=1 << 20)
    assert [n for n, _ in iter_tensors(read_manifest(manifest.folder / MANIFEST))] == ["only"]


# -- broadcast group --------------------------------------------------------------------------


def _receive(port: int, rank: int, world_size: int, bucket_metas: list[list[TensorMeta]], out) -> None:
    store = broadcast_group.connect_store("127.0.0.1", port, world_size, timeout_s=60)
    group = broadcast_group.join(store, "test", rank, world_size, "gloo", timeout_s=60)
    hasher = WeightsHasher()
    for metas in bucket_metas:
        buffer = torch.empty(layout(metas)[1], dtype=torch.uint8)
        group.broadcast(buffer)
        for name, tensor in unpack_bucket(buffer, metas):
            hasher.update(name, tensor)
    group.close()
    out.put((rank, hasher.hexdigest()))


def test_gloo_broadcast_between_processes_is_bit_exact():
    named = sample_tensors() * 3
    named = [(f"{i}.{n}", t) for i, (n, t) in enumerate(named)]
    packed = list(packed_buckets(named, 128, torch.device("cpu")))
    assert len(packed) > 2
    world_size = 3
    store = broadcast_group.open_store("127.0.0.1", world_size, timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    receivers = [
        ctx.Process(target=_receive, args=(store.port, rank, world_size, [m for _, m in packed], out))
        for rank in range(1, world_size)
    ]
    for p in receivers:
        p.start()
    try:
        group = broadcast_group.join(store, "test", 0, world_size, "gloo", timeout_s=60)
        assert broadcast_group.arrived(store, "test") == world_size - 1
        for buffer, _ in packed:
            group.broadcast(buffer)
        results = dict(out.get(timeout=60) for _ in receivers)
        group.close()
    finally:
        for p in receivers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == {1: digest(named), 2: digest(named)}


def test_backend_follows_the_tensors_device():
    assert broadcast_group.backend_for(torch.device("cpu")) == "gloo"
    assert broadcast_group.backend_for(torch.device("cuda", 0)) == "nccl"


def _receive_nccl(port: int, out) -> None:
    torch.cuda.set_device(1)
    store = broadcast_group.connect_store("127.0.0.1", port, 2, timeout_s=60)
    group = broadcast_group.join(store, "nccl", 1, 2, "nccl", timeout_s=60)
    buffer = torch.empty(1000, dtype=torch.uint8, device=broadcast_group.buffer_device("nccl"))
    group.broadcast(buffer)
    out.put(buffer.cpu().tolist())
    group.close()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL broadcast needs two CUDA devices")
def test_nccl_broadcast_between_processes():
    torch.cuda.set_device(0)
    store = broadcast_group.open_store("127.0.0.1", 2, timeout_s=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    receiver = ctx.Process(target=_receive_nccl, args=(store.port, out))
    receiver.start()
    try:
        sent = (torch.arange(1000) % 251).to(torch.uint8).cuda()
        assert broadcast_group.backend_for(sent.device) == "nccl"
        group = broadcast_group.join(store, "nccl", 0, 2, "nccl", timeout_s=60)
        group.broadcast(sent)
        assert out.get(timeout=60) == sent.cpu().tolist()
        group.close()
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()


# -- sender -> receiver, as a worker rank runs them (without vLLM) ------------------------------


def _worker_rank(conn) -> None:
    """One worker rank: what fleetrl's weight-transfer backend does with each weight-sync call,
    less vLLM's reload (engine/weight_receiver.py): the transport's receiver takes the bytes in
    and the rank hashes them."""
    receiver, transport, hasher = None, "", None
    while (call := conn.recv()) is not None:
        method, args = call
        try:
            result = None
            if method == "membership":
                result = (1, receiver is not None and receiver.state == args[0])
            elif method == "init":
                init = parse_init(args[0])
                receiver, transport = spec(init.transport).receiver_class().join(init, 0), init.transport
            elif method == "start":
                hasher = WeightsHasher()
            elif method == "update":
                for batch in receiver.receive(parse_update(transport, args[0])):
                    hasher.update_all(batch)
            elif method == "finish":
                result = hasher.hexdigest()
            conn.send(("ok", result))
        except Exception as e:
            conn.send(("error", repr(e)))


class PipeWorker:
    """A one-rank worker's weight-sync client: every call goes to `_worker_rank` in a process of
    its own (a broadcast's sender and receiver block in the same collective), and its answer is
    kept, in order."""

    worker_id = "pipe-worker"

    def __init__(self, conn) -> None:
        self.conn = conn
        self.answers: list[tuple[str, object]] = []  # (method, what the rank answered)

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)

        async def call(*args):
            import asyncio

            def round_trip():
                self.conn.send((method, args))
                return self.conn.recv()

            status, result = await asyncio.to_thread(round_trip)
            assert status == "ok", f"{method}: {result}"
            self.answers.append((method, result))
            return result

        return call


@contextmanager
def pipe_worker() -> Iterator[PipeWorker]:
    """A PipeWorker whose rank runs in a spawned process for the block, stopped however it ends."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    rank = ctx.Process(target=_worker_rank, args=(child,), daemon=True)
    rank.start()
    try:
        yield PipeWorker(conn)
    finally:
        conn.send(None)
        rank.join(timeout=30)
        if rank.is_alive():
            rank.kill()


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_each_transport_delivers_to_its_receiver_bit_exact(kind, tmp_path):
    """The sender's checksum is the receiving rank's, over the wire records both sides read; the
    second broadcast publish reuses the group the first formed (one init), while the filesystem
    transport, with no group, inits every time."""
    import asyncio

    from fleetrl.weights.factory import make_transport

    named = [(f"{i}.{n}", t) for i, (n, t) in enumerate(sample_tensors() * 3)]

    async def publish_twice() -> list[str]:
        transport = make_transport(kind, host="127.0.0.1", bucket_bytes=128, storage_dir=tmp_path, timeout_s=60)
        try:
            return [await transport.transfer([worker], lambda: iter(named), version) for version in (1, 2)]
        finally:
            await transport.close()

    with pipe_worker() as worker:
        sent = asyncio.run(publish_twice())
    calls = [method for method, _ in worker.answers]
    assert sent == [checksum for method, checksum in worker.answers if method == "finish"] == [digest(named)] * 2
    if kind == "broadcast":
        assert calls.count("init") == 1 and calls.count("update") == 2 * len(list(iter_buckets(named, 128)))
    if kind == "filesystem":
        assert calls.count("init") == calls.count("update") == 2


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_each_registered_transport_is_one_package_whose_spec_names_its_sides(kind):
    """A registry line names a package of weights/ whose SPEC is the transport's: its records
    carry its name, and its receiver is that package's receiver.py (so the import rules hold
    it to the worker's side)."""
    transport = spec(kind)
    assert TRANSPORTS[kind] == f"fleetrl.weights.{kind}" and transport.name == kind
    assert transport.init.transport == kind and transport.init.__module__ == f"fleetrl.weights.{kind}.wire"
    assert transport.update.__module__ == f"fleetrl.weights.{kind}.wire"
    assert transport.receiver.startswith(f"fleetrl.weights.{kind}.receiver:")
    assert transport.sender.startswith(f"fleetrl.weights.{kind}.sender:")
    receiver, sender = transport.receiver_class(), transport.sender_class()
    assert all(callable(getattr(receiver, m)) for m in ("join", "receive", "reset_on_failure", "close"))
    assert isinstance(receiver.state, property) and callable(sender.from_settings)


# -- sender plumbing and engine registration ---------------------------------------------------


def test_run_together_breaks_the_collective_and_reports_the_earliest_step():
    import asyncio

    from fleetrl.weights.fanout import run_together

    broken = asyncio.Event()

    async def worker_call():
        await asyncio.sleep(0.01)
        raise RuntimeError("worker-1 rejected the bucket")

    async def sender_broadcast():
        await broken.wait()  # a blocked collective, until on_failure breaks it
        raise RuntimeError("connection closed by peer")

    with pytest.raises(RuntimeError, match="worker-1 rejected"):
        asyncio.run(asyncio.wait_for(run_together(worker_call(), sender_broadcast(), on_failure=broken.set), 5))


def test_the_sender_side_imports_neither_vllm_nor_engine_code():
    import subprocess
    import sys

    code = ("import sys, fleetrl.weights.factory; "
            "bad = [m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.', 'fleetrl.engine'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_worker_extension_registers_the_backend_once():
    pytest.importorskip("vllm")
    import importlib

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import fleetrl.engine.worker_extension as extension
    from fleetrl.engine.weight_receiver import FleetrlWeightReceiver

    importlib.reload(extension)  # a second import must not fail
    assert WeightTransferEngineFactory._registry["fleetrl"]() is FleetrlWeightReceiver
    assert all(name.startswith(("fleetrl_", "_fleetrl_")) for name in vars(extension.FleetrlWorkerExtension)
               if not name.startswith("__"))


def test_tied_layers_are_found_for_reprocessing():
    pytest.importorskip("vllm")
    from fleetrl.engine.weight_receiver import _tied_followers

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.body = torch.nn.Linear(4, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    assert _tied_followers(model) == [model.head]
