"""The process the `math` reward scores in, run as a script (`python -I math_worker.py`) so that it
imports math-verify alone, neither fleetrl nor torch. It writes `ready` once math-verify is
imported; then each line of its stdin is a JSON `[completion, answer]`, answered by one line
of JSON on its stdout: `{"score": float}`, or `{"error": text}`: a ValueError's first line
(an answer it cannot parse), or any other error's type and first line. A parse or a
comparison that never ends (`\\boxed{9^{9^{9^{9}}}}`: sympy's big integers, holding the GIL)
is the caller's to stop, by killing this process (fleetrl.envs.rewards.math_equal).
"""

import json
import logging
import signal
import sys


def score(math_verify, completion: str, answer: str) -> float:
    gold = answer.strip()
    if "$" not in gold and "\\boxed" not in gold:  # a bare answer (`x+1`, `\frac12`) parses as LaTeX math
        gold = f"${gold}$"
    # No math-verify time limits: they are signals, and the caller bounds the call instead.
    parsed_gold = math_verify.parse(gold, parsing_timeout=None)
    if not parsed_gold:
        raise ValueError(f"math-verify cannot parse the answer {answer[:100]!r}")
    parsed = math_verify.parse(completion, parsing_timeout=None)
    return float(math_verify.verify(parsed_gold, parsed, timeout_seconds=None))


def main() -> None:
    # It shares fleetrl's process group: a Ctrl-C is fleetrl's to handle; this process ends when
    # fleetrl closes its stdin or dies (the parent-death signal), without a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies, sys.stdout = sys.stdout, sys.stderr  # whatever a library prints is not a reply
    import math_verify

    # Its warning that time limits are off: they are off on purpose.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        completion, answer = json.loads(line)
        try:
            reply = {"score": score(math_verify, completion, answer)}
        except Exception as e:
            text = str(e).strip().splitlines()
            first = text[0] if text else ""
            reply = {"error": first if type(e) is ValueError and first else f"{type(e).__name__}: {first}".rstrip(": ")}
        print(json.dumps(reply), file=replies, flush=True)


if __name__ == "__main__":
    main()
