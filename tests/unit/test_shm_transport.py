"""The shared-memory transport on its own: a version moved between two real processes through
the host's shared memory, its file gone once the update is over, a changed file or a file that is
not a version file of this user refused before any tensor is handed over, and the files of a
killed trainer removed by the next transport."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest
import torch

from fleetrl.transports import check_name
from fleetrl.weights.shm import receiver as receiver_module
from fleetrl.weights.shm.receiver import ShmReceiver
from fleetrl.weights.shm.sender import ShmTransport, remove_orphans
from fleetrl.weights.shm.wire import SHM_DIR, ShmInit, ShmVersion

from .test_weights import digest, pipe_worker, sample_tensors


def version_file(folder, pid: int | None = None, version: int = 1):
    return folder / f"fleetrl-weights-{pid or os.getpid()}-{uuid.uuid4().hex}-v{version}.bin"


def written(transport: ShmTransport, path, tensors) -> tuple[dict, str]:
    """`transport`'s own write of `tensors` into a new file at `path`."""
    return transport._write(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), path, tensors)


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A folder the receiver takes for the host's shared memory."""
    monkeypatch.setattr(receiver_module, "SHM_DIR", tmp_path)
    return tmp_path


def test_a_version_crosses_to_another_process_and_leaves_no_file():
    named = [(f"{i}.{n}", t) for i, (n, t) in enumerate(sample_tensors() * 2)]
    transport = ShmTransport(SHM_DIR, bucket_bytes=64, timeout_s=60)  # several buckets per file
    with pipe_worker() as worker:
        sent = [asyncio.run(transport.transfer([worker], lambda: iter(named), version)) for version in (1, 2)]
    assert sent == [checksum for method, checksum in worker.answers if method == "finish"] == [digest(named)] * 2
    assert list(SHM_DIR.glob(f"fleetrl-weights-{os.getpid()}-*")) == []


def test_a_changed_file_is_refused_before_any_tensor(shm_dir):
    transport = ShmTransport(shm_dir, bucket_bytes=1 << 20, timeout_s=60)
    path = version_file(shm_dir)
    update_info, _ = written(transport, path, sample_tensors())
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))
    receiver = ShmReceiver.join(ShmInit(), 0)
    with pytest.raises(ValueError, match="does not match its sha256"):
        next(receiver.receive(ShmVersion(**update_info)))
    path.write_bytes(bytes(data[:-16]))
    with pytest.raises(ValueError, match="holds .* bytes"):
        next(receiver.receive(ShmVersion(**update_info)))


def test_only_a_version_file_of_this_user_in_shared_memory_is_read(shm_dir, tmp_path_factory):
    transport = ShmTransport(shm_dir, bucket_bytes=1 << 20, timeout_s=60)
    path = version_file(shm_dir)
    update_info = written(transport, path, sample_tensors())[0]
    receiver = ShmReceiver.join(ShmInit(), 0)
    elsewhere = tmp_path_factory.mktemp("elsewhere") / path.name
    elsewhere.write_bytes(path.read_bytes())
    renamed = shm_dir / "weights.bin"
    renamed.write_bytes(path.read_bytes())
    for other in (elsewhere, renamed):
        with pytest.raises(ValueError, match="is not a version file in"):
            next(receiver.receive(ShmVersion(**{**update_info, "path": str(other)})))
    link = version_file(shm_dir, version=2)
    link.symlink_to(path)
    with pytest.raises(OSError):  # O_NOFOLLOW
        next(receiver.receive(ShmVersion(**{**update_info, "path": str(link)})))
    hard = version_file(shm_dir, version=3)
    os.link(path, hard)
    with pytest.raises(ValueError, match="is not a file of this user's alone"):
        next(receiver.receive(ShmVersion(**{**update_info, "path": str(hard)})))


def test_the_receiver_hands_over_the_tensors_sent(shm_dir):
    transport = ShmTransport(shm_dir, bucket_bytes=1 << 20, timeout_s=60)
    path = version_file(shm_dir)
    update_info, checksum = written(transport, path, sample_tensors())
    (batch,) = ShmReceiver.join(ShmInit(), 0).receive(ShmVersion(**update_info))
    path.write_bytes(b"\0" * path.stat().st_size)  # too late: the tensors are the rank's own
    assert digest(batch) == checksum == digest(sample_tensors())
    for (name, got), (sent_name, sent) in zip(batch, sample_tensors()):
        assert name == sent_name and got.dtype == sent.dtype and torch.equal(got, sent)


def test_a_killed_writers_files_are_removed_by_the_next_transport(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan, mine, other = version_file(tmp_path, int(dead.stdout)), version_file(tmp_path), tmp_path / "notes.bin"
    for path in (orphan, mine, other):
        path.write_bytes(b"x")
    remove_orphans(tmp_path)
    assert sorted(tmp_path.iterdir()) == sorted([mine, other])


def test_a_transport_name_of_any_json_type_gets_one_value_error():
    with pytest.raises(ValueError, match=r"weight transport: \['shm'\] is not one of"):
        check_name(["shm"], "weight transport")
