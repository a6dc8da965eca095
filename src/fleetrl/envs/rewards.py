"""The reward menu: how an environment judges a completion against its task's answer.

Every reward is a function `(completion: str, answer, **options) -> float` in [0, 1], and
`resolve_reward(spec, **options)` gives the one `spec` names with its options bound, as a
function of `(completion, answer)`. The answer is compared as `str(answer)`, stripped:

- `exact`: 1 when the completion, stripped, is the answer;
- `contains`: 1 when the answer occurs in the completion;
- `regex`: option `pattern`, a regular expression with exactly one group; 1 when that group of
  its last match in the completion (the final answer, where a model restates), stripped, is
  the answer;
- `math`: Hugging Face's math-verify parses the answer and the completion (LaTeX or plain
  numbers and expressions, `\\boxed{}` first, else the last one given) and compares them as
  mathematics: `1/2`, `0.5` and `\\frac{1}{2}` are equal. An answer it cannot parse raises,
  so its samples are dropped with that reason rather than scored 0;
- `module.path:function`: a user's function with the same signature, imported as environments
  are (the current directory on sys.path): `function(completion, answer, **options)`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

from fleetrl.envs.base import EnvError
from fleetrl.envs.imports import load_attribute

Reward = Callable[[str, Any], float]


def exact(completion: str, answer: Any) -> float:
    return float(completion.strip() == str(answer).strip())


def contains(completion: str, answer: Any) -> float:
    needle = str(answer).strip()
    return float(bool(needle) and needle in completion)


def regex(completion: str, answer: Any, pattern: str) -> float:
    found = re.findall(pattern, completion)  # one group: the group's text of each match
    return float(bool(found) and found[-1].strip() == str(answer).strip())


def math_equal(completion: str, answer: Any) -> float:
    math_verify = _math_verify()
    gold = str(answer).strip()
    if "$" not in gold and "\\boxed" not in gold:  # a bare answer (`x+1`, `\frac12`) parses as LaTeX math
        gold = f"${gold}$"
    # No signal-based time limits: they work on the main thread only, and the orchestrator
    # scores in worker threads under orchestrator.reward_timeout_s instead.
    parsed_gold = math_verify.parse(gold, parsing_timeout=None)
    if not parsed_gold:
        raise ValueError(f"math-verify cannot parse the answer {str(answer)[:100]!r}")
    parsed = math_verify.parse(completion, parsing_timeout=None)
    return float(math_verify.verify(parsed_gold, parsed, timeout_seconds=None))


MENU: dict[str, Callable[..., float]] = {"exact": exact, "contains": contains, "regex": regex, "math": math_equal}


def resolve_reward(spec: str, **options: Any) -> Reward:
    """The reward `spec` names (a MENU name or `module.path:function`), with `options` bound;
    an EnvError of one line for an unknown name, a function that cannot be imported, or options
    its signature does not take."""
    where = f"reward {spec}"
    if spec in MENU:
        fn = MENU[spec]
    elif ":" in spec:
        fn = load_attribute(where, *spec.split(":", 1))
    else:
        raise EnvError(f"unknown reward '{spec}' (the menu: {', '.join(MENU)}; or module.path:function)")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): its first call checks the options
        signature = None
    if signature is not None:
        try:
            signature.bind("completion", "answer", **options)
        except TypeError as e:
            takes = ", ".join(name if p.default is p.empty else f"{name}={p.default!r}"
                              for name, p in signature.parameters.items())
            raise EnvError(f"{where}: {e} (it takes {takes})") from None
    if fn is regex:
        _check_pattern(options["pattern"], where)
    return functools.partial(fn, **options) if options else fn


def _check_pattern(pattern: Any, where: str) -> None:
    try:
        groups = re.compile(pattern).groups
    except (re.error, TypeError) as e:
        raise EnvError(f"{where}: pattern {pattern!r} is not a regular expression ({e})") from None
    if groups != 1:
        raise EnvError(f"{where}: pattern {pattern!r} has {groups} groups; it needs exactly one, the answer")


@functools.cache
def _math_verify():
    # Imported on first use: it brings sympy and a LaTeX parser, a second or more.
    import math_verify

    # Its warning that time limits are off, once per process: fleetrl set them off on purpose.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify
