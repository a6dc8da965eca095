"""The shared-memory transport on its own: a version moved between two real processes through
the host's shared memory, its file gone once the update is over, and a changed file refused
before any tensor is handed over."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.multiprocessing as mp

from fleetrl.weights.shm.receiver import ShmReceiver
from fleetrl.weights.shm.sender import ShmTransport
from fleetrl.weights.shm.wire import ShmInit, ShmVersion

from .test_weights import PipeWorker, _worker_rank, digest, sample_tensors


def test_a_version_crosses_to_another_process_and_leaves_no_file(tmp_path):
    named = [(f"{i}.{n}", t) for i, (n, t) in enumerate(sample_tensors() * 2)]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    rank = ctx.Process(target=_worker_rank, args=(child,), daemon=True)
    rank.start()
    worker = PipeWorker(conn)
    transport = ShmTransport(tmp_path, bucket_bytes=64, timeout_s=60)  # several buckets per file
    try:
        sent = [asyncio.run(transport.transfer([worker], lambda: iter(named), version)) for version in (1, 2)]
    finally:
        conn.send(None)
        rank.join(timeout=30)
        if rank.is_alive():
            rank.kill()
    assert sent == [checksum for method, checksum in worker.answers if method == "finish"] == [digest(named)] * 2
    assert list(tmp_path.iterdir()) == []


def test_a_changed_file_is_refused_before_any_tensor(tmp_path):
    transport = ShmTransport(tmp_path, bucket_bytes=1 << 20, timeout_s=60)
    path = tmp_path / "version.bin"
    update_info, _ = transport._write(path, sample_tensors())
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))
    receiver = ShmReceiver.join(ShmInit(), 0)
    with pytest.raises(ValueError, match="does not match its sha256"):
        next(receiver.receive(ShmVersion(**update_info)))
    path.write_bytes(bytes(data[:-16]))
    with pytest.raises(ValueError, match="holds .* bytes"):
        next(receiver.receive(ShmVersion(**update_info)))


def test_the_receiver_hands_over_the_tensors_sent(tmp_path):
    transport = ShmTransport(tmp_path, bucket_bytes=1 << 20, timeout_s=60)
    update_info, checksum = transport._write(tmp_path / "version.bin", sample_tensors())
    (batch,) = ShmReceiver.join(ShmInit(), 0).receive(ShmVersion(**update_info))
    assert digest(batch) == checksum == digest(sample_tensors())
    for (name, got), (sent_name, sent) in zip(batch, sample_tensors()):
        assert name == sent_name and got.dtype == sent.dtype and torch.equal(got, sent)
