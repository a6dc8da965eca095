"""A launched worker's engine core started by fork on CPUs, not spawn: imports are paid once.

vLLM's CPU platform starts every child by spawn (vllm/platforms/cpu.py), so the engine core of a
server is a new interpreter that imports torch, transformers and vLLM again: 7.5 s of the 20.6
a launched server takes to serve (benchmarks/bench_engine_start.py). Forked, it inherits the
modules the server has already imported. A CPU has no device context, and with
VLLM_ENABLE_V1_MULTIPROCESSING=0 (config/vllm.py) the engine core starts no workers of its own.
One thing fork does break must stay absent: torch's OpenMP (GNU libgomp) deadlocks in a child
whose parent ran a parallel region, so the server must run no tensor work of its own before its
engine starts (it runs none today). The child first drops the signal wakeup descriptor of the
server's event loop and the TCP sockets it inherited, which it never uses: among them the
server's HTTP port (a Dynamo worker's system port), which only the server may hold, or a port
that a killed server freed would stay taken by its engine core. Native servers
(engine/serve.py) and Dynamo's workers (engine/dynamo_worker.py) both start this way.
"""

from __future__ import annotations

import multiprocessing.context
import os
import signal
import socket


def _drop_inherited_tcp_sockets() -> None:
    """Points each inherited TCP socket's descriptor at /dev/null: this copy of the socket is
    gone, and its number stays taken, so that a socket object the child still holds can never
    reach whatever would reuse the number."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                sock = socket.socket(fileno=fd)
            except OSError:  # not a socket (or the listing's own descriptor, closed since)
                continue
            family = sock.family
            sock.detach()
            if family in (socket.AF_INET, socket.AF_INET6):
                os.dup2(devnull, fd)  # this copy only: the server's own stays open, unshut
    finally:
        os.close(devnull)


class _ForkedProcess(multiprocessing.context.ForkProcess):
    def run(self) -> None:
        # The server's event loop wakes on this descriptor: a signal to the engine core would
        # otherwise run the server's handler too (Python 3.12's asyncio resets it at fork).
        signal.set_wakeup_fd(-1)
        _drop_inherited_tcp_sockets()
        super().run()


class _ForkContext(multiprocessing.context.ForkContext):
    Process = _ForkedProcess


def fork_engine_cores() -> None:
    """On a CPU, this process's vLLM engine cores start by fork (call before the engine starts)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm.v1.engine.utils as engine_utils

        engine_utils.get_mp_context = _ForkContext
