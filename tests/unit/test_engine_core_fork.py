"""A forked engine core keeps none of its server's TCP sockets nor the server loop's signal
wakeup (engine/engine_core_fork.py), and a Dynamo worker's NIXL stand-in lets a forked core walk
the modules (engine/dynamo_worker.py)."""

import asyncio
import os
import signal
import socket
import stat

import pytest

from fleetrl.engine.engine_core_fork import _ForkContext


def _report(fds: dict[str, int], out) -> None:
    for name, fd in fds.items():
        out.send(f"{name} {'a socket' if stat.S_ISSOCK(os.fstat(fd).st_mode) else 'not a socket'}")
    out.send(f"wakeup {signal.set_wakeup_fd(-1)}")
    out.close()


def _reports_of_a_forked_child(fds: dict[str, int]) -> list[str]:
    context = _ForkContext()
    reports, out = context.Pipe(duplex=False)
    child = context.Process(target=_report, args=(fds, out))
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
    return seen


def test_the_forked_child_drops_inherited_tcp_sockets_and_the_loops_wakeup():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    ours, theirs = socket.socketpair()  # AF_UNIX: how the engine core talks to its server (ZMQ ipc)
    loop = asyncio.new_event_loop()  # as the server's: its signal wakeup is a socketpair of its own
    loop.add_signal_handler(signal.SIGUSR1, lambda: None)
    try:
        seen = _reports_of_a_forked_child(
            {"listener": listener.fileno(), "client": client.fileno(), "unix": ours.fileno()})
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
        loop.close()
    assert seen == ["listener not a socket", "client not a socket", "unix a socket", "wakeup -1"]
    # The parent's own copies are untouched: the listener still accepts.
    accepted, _ = listener.accept()
    for sock in (accepted, listener, client, ours, theirs):
        sock.close()


def test_the_dynamo_workers_nixl_stand_in_answers_hasattr_and_still_refuses_use(monkeypatch):
    nixl_connect = pytest.importorskip("dynamo.nixl_connect")
    from fleetrl.engine.dynamo_worker import _let_hasattr_probe_the_nixl_stand_in

    stand_in_class = nixl_connect._NixlImportProxy
    monkeypatch.setattr(stand_in_class, "__getattr__", stand_in_class.__getattr__)  # restored after
    _let_hasattr_probe_the_nixl_stand_in()
    stand_in = stand_in_class("nixl._api", ImportError("no nixl"))
    assert not hasattr(stand_in, "__dict__")
    with pytest.raises(ImportError, match="NIXL"):
        stand_in.nixl_agent
