"""`reasoning_gym:<dataset>`: any procedural dataset of the `reasoning-gym` library, scored by
the dataset's own `score_answer`, as an endless task stream that is exact per seed and seekable
by position (`tasks_from`), with a held-out split by a hash of each prompt. Options, prompt,
reward, task ids, the datasets refused (REFUSED) and those reproducible only under a fixed
PYTHONHASHSEED: docs/environments.md, "reasoning-gym tasks". `reasoning-gym` is optional and
imported only when such an environment is built."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.util
import itertools
import math
from collections.abc import Iterator
from typing import Any

from fleetrl.envs.base import EnvError, HeldOutSplit, Rollout, Task, held_out
from fleetrl.errors import one_line

CLOSE_NAMES = 5  # how many dataset names an unknown name's error suggests
# Datasets whose tasks the seed does not determine, so a resume would not draw the same ones.
REFUSED = {
    "codeio": "its tasks depend on Python's global random state, not on the seed alone",
    "list_functions": "the same seed gives different tasks even within one process",
}


def _import_reasoning_gym():
    if importlib.util.find_spec("reasoning_gym") is None:
        raise EnvError("reasoning_gym environments need the 'reasoning-gym' package, which scripts/setup.sh "
                       "installs: pip install -e '.[reasoning-gym]'")
    import reasoning_gym
    import reasoning_gym.factory
    import reasoning_gym.utils

    return reasoning_gym


class ReasoningGymEnvironment(HeldOutSplit):
    def __init__(self, dataset: str, **options: Any) -> None:
        self.name = f"reasoning_gym:{dataset}"
        self._rg = rg = _import_reasoning_gym()
        datasets = rg.factory.DATASETS
        if dataset not in datasets:
            close = difflib.get_close_matches(dataset, datasets, n=CLOSE_NAMES, cutoff=0.5)
            hint = f"close: {', '.join(close)}" if close else f"e.g. {', '.join(sorted(datasets)[:CLOSE_NAMES])}"
            raise EnvError(f"env {self.name}: reasoning_gym has no dataset '{dataset}' ({hint}; "
                           f"{len(datasets)} in all)")
        if dataset == "composite":
            raise EnvError(f"env {self.name}: mix reasoning_gym datasets with [[orchestrator.envs]] instead")
        if dataset in REFUSED:
            raise EnvError(f"env {self.name}: not supported: {REFUSED[dataset]} (a resumed run would not draw "
                           "the same tasks)")
        fields = [f.name for f in dataclasses.fields(datasets[dataset][1]) if f.name != "seed"]
        if "seed" in options:
            raise EnvError(f"env {self.name}: option 'seed': the run's seed (run.seed) seeds the tasks")
        if unknown := sorted(set(options) - set(fields)):
            raise EnvError(f"env {self.name}: unknown option '{unknown[0]}' (the dataset's config fields: "
                           f"{', '.join(fields)})")
        self.dataset = dataset
        self.options = options
        try:
            # The dataset that scores: `score_answer` depends on the config, not on the seed.
            self._scorer = rg.create_dataset(dataset, seed=0, **options)
        except Exception as e:  # the configs check themselves with asserts, or fail on a wrong type
            raise EnvError(f"env {self.name}: options {options}: {one_line(e)}") from None
        if not isinstance(self._scorer.size, int) or self._scorer.size < 1:
            raise EnvError(f"env {self.name}: option 'size' must be an integer >= 1, got {self._scorer.size!r}")

    def generate(self, seed: int) -> Iterator[Task]:
        for chunk in itertools.count():
            for slot, entry in enumerate(self._chunk(seed, chunk)):
                yield self._task(f"{seed}-{chunk * self._scorer.size + slot}", entry)

    def tasks(self, seed: int) -> Iterator[Task]:
        return self.tasks_from(seed, 0)

    def tasks_from(self, seed: int, start: int) -> Iterator[Task]:
        """The training stream from position `start` on, creating only the chunks from `start`'s:
        slot s of chunk c is entry s of the chunk's dataset, or where that is held out, entry s
        of the chunk's first replacement dataset whose entry s is not."""
        size = self._scorer.size
        first_chunk, first_slot = divmod(start, size)
        for chunk in itertools.count(first_chunk):
            datasets = [self._chunk(seed, chunk)]  # then its replacements, created when a slot needs one
            for slot in range(first_slot if chunk == first_chunk else 0, size):
                position = chunk * size + slot
                for attempt in itertools.count():
                    if attempt == len(datasets):
                        datasets.append(self._chunk(seed, chunk, attempt))
                    task = self._task(f"{seed}-{position}" + (f"r{attempt}" if attempt else ""),
                                      datasets[attempt][slot])
                    if not held_out(task):
                        break
                yield task

    def _chunk(self, seed: int, chunk: int, replacement: int = 0) -> Any:
        """Chunk `chunk`'s dataset (`replacement` > 0: that replacement of it)."""
        key = f"{seed}/{chunk}" + (f"/{replacement}" if replacement else "")
        # 31 bits: a dataset may seed numpy with `seed + index`, which must stay below 2**32.
        chunk_seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") >> 1
        return self._rg.create_dataset(self.dataset, seed=chunk_seed, **self.options)

    def _task(self, task_id: str, entry: dict[str, Any]) -> Task:
        system = {"role": "system", "content": self._rg.utils.SYSTEM_PROMPTS["default"]}
        return Task(id=task_id, messages=[system, {"role": "user", "content": entry["question"]}], answer=entry)

    def reward(self, rollout: Rollout) -> float:
        answer = self._rg.utils.extract_answer(rollout.completion)
        try:
            value = float(self._scorer.score_answer(answer, rollout.task.answer))
        except Exception:  # e.g. prime_factorization raises ValueError on an answer that is not numbers
            return 0.0
        return 0.0 if math.isnan(value) else min(max(value, 0.0), 1.0)
