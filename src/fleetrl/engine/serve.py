"""`python -m fleetrl.engine.serve ARGS...`: vLLM's OpenAI API server, run in this process, that
takes its whole process group down if fleetrl dies.

vLLM's engine core and workers are grandchildren of fleetrl: a kernel parent-death signal on
the API server alone would leave them running (seen when fleetrl was OOM-killed). This process
leads its own process group (fleetrl starts it with setsid); a watcher thread notices the
parent is gone and kills the group, engine included.
"""

import os
import runpy
import signal
import sys
import threading
import time


def _kill_group_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.killpg(0, signal.SIGKILL)


def main() -> None:
    threading.Thread(target=_kill_group_when_orphaned, args=(os.getppid(),), daemon=True).start()
    module = "vllm.entrypoints.openai.api_server"
    sys.argv = [module, *sys.argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
