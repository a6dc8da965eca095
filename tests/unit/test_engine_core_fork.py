"""A forked engine core keeps none of its server's TCP sockets (engine/engine_core_fork.py), and
a Dynamo worker's NIXL stand-in lets a forked core walk the modules (engine/dynamo_worker.py)."""

import os
import socket

import pytest

from fleetrl.engine.engine_core_fork import _ForkContext


def _report_open(fds: dict[str, int], out) -> None:
    for name, fd in fds.items():
        try:
            os.fstat(fd)
            out.send(f"{name} open")
        except OSError:
            out.send(f"{name} closed")
    out.close()


def test_the_forked_child_closes_inherited_tcp_sockets_and_keeps_the_others():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    ours, theirs = socket.socketpair()  # AF_UNIX: how the engine core talks to its server (ZMQ ipc)
    context = _ForkContext()
    reports, out = context.Pipe(duplex=False)
    child = context.Process(target=_report_open, args=(
        {"listener": listener.fileno(), "client": client.fileno(), "unix": ours.fileno()}, out))
    child.start()
    out.close()
    seen = []
    while True:
        try:
            seen.append(reports.recv())
        except EOFError:
            break
    child.join(30)
    assert child.exitcode == 0
    assert seen == ["listener closed", "client closed", "unix open"]
    # The parent's own copies are untouched: the listener still accepts.
    accepted, _ = listener.accept()
    for sock in (accepted, listener, client, ours, theirs):
        sock.close()


def test_the_dynamo_workers_nixl_stand_in_answers_hasattr_and_still_refuses_use():
    nixl_connect = pytest.importorskip("dynamo.nixl_connect")
    from fleetrl.engine.dynamo_worker import _apply_import_fixes

    _apply_import_fixes()
    stand_in = nixl_connect._NixlImportProxy("nixl._api", ImportError("no nixl"))
    assert not hasattr(stand_in, "__dict__")
    with pytest.raises(ImportError, match="NIXL"):
        stand_in.nixl_agent
