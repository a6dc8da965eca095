"""`python -m fleetrl.engine.serve ARGS...`: vLLM's OpenAI API server, run in this process, that
takes its whole process group down if fleetrl dies (engine/orphan.py) and forks its engine core
(engine/engine_core_fork.py)."""

import runpy
import sys

from fleetrl.engine.engine_core_fork import fork_engine_cores
from fleetrl.engine.orphan import die_with_parent


def main() -> None:
    die_with_parent()
    fork_engine_cores()
    module = "vllm.entrypoints.openai.api_server"
    sys.argv = [module, *sys.argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
