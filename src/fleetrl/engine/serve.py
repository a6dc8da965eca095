"""`python -m fleetrl.engine.serve ARGS...`: vLLM's OpenAI API server, run in this process, that
takes its whole process group down if fleetrl dies (engine/orphan.py) and forks its engine core
(engine/engine_core_fork.py)."""

import importlib
import runpy
import sys

from fleetrl.engine.engine_core_fork import fork_engine_cores
from fleetrl.engine.orphan import die_with_parent
from fleetrl.heavy_imports import imports_without_gc

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# What that module, a shim, imports: most of the libraries the server needs.
SERVER_ENTRY = "vllm.entrypoints.launchers.api_server.entry"


def main() -> None:
    die_with_parent()
    with imports_without_gc():
        importlib.import_module(SERVER_ENTRY)
    fork_engine_cores()
    sys.argv = [SERVER_MODULE, *sys.argv[1:]]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
