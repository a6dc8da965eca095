"""dataset: train on the rows of a data file, each a prompt and the answer a reward judges. The
file (`path`: JSON Lines, JSON, Parquet, CSV, or a folder `datasets` saved) is read by
`fleetrl.data_files` as a memory-mapped table and checked whole when the environment is made;
`tasks(seed)` visits every training row once per pass in a seeded order (task `row17-pass2`),
reading rows a batch at a time, and a resume seeks to its task reading no row before it. The
options, the checks, the tasks and the held-out split: docs/environments.md, "Datasets"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from fleetrl.envs.base import EnvError, Rollout, Task
from fleetrl.envs.rewards import resolve_reward

if TYPE_CHECKING:
    import datasets

# Rows read from the table at once: few Arrow reads per step, little held in memory.
READ_BATCH = 256
# The seed that picks eval_fraction's rows: fixed, so that every run holds out the same rows.
HELD_OUT_SEED = 0


class DatasetEnvironment:
    name = "dataset"

    def __init__(self, path: str, prompt_field: str = "prompt", answer_field: str = "answer",
                 system_prompt: str | None = None, split: str | None = None, eval_split: str | None = None,
                 eval_fraction: float = 0.0, reward: str = "math",
                 reward_options: dict[str, Any] | None = None) -> None:
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        if eval_split is not None and eval_fraction:
            raise ValueError("eval_split and eval_fraction are both set: hold out a split, or a fraction of the rows")
        try:
            self.judge = resolve_reward(reward, **(reward_options or {}))
        except EnvError as e:  # a ValueError: the options are at fault, and the message says how
            raise ValueError(str(e)) from None
        # Imported here: `datasets` takes seconds to import, which every command would pay.
        from fleetrl.data_files import check_fields, load_table

        self.prompt_field, self.answer_field, self.system_prompt = prompt_field, answer_field, system_prompt
        fields = {prompt_field: ("text", "messages"), answer_field: "any"}
        columns = list(dict.fromkeys(fields))  # the two fields once, should they be one
        table = load_table(path, split)
        check_fields(table, path, fields)
        self.table = table.select_columns(columns)
        self.train_rows = np.arange(len(table))
        if eval_split is not None:
            held_out = load_table(path, eval_split)
            if held_out.cache_files == table.cache_files:  # the same split (a default of None is resolved)
                raise ValueError(f"eval_split '{eval_split}' is the split trained on; hold out another split of {path}")
            check_fields(held_out, f"{path} split '{eval_split}'", fields)
            self.eval_table, self.eval_rows = held_out.select_columns(columns), np.arange(len(held_out))
            self.eval_tasks = self._eval_tasks
        elif eval_fraction:
            count = round(len(table) * eval_fraction) or 1
            if count >= len(table):
                raise ValueError(f"eval_fraction = {eval_fraction} of {path}'s {len(table)} rows leaves none to "
                                 "train on")
            held = np.zeros(len(table), dtype=bool)
            held[np.random.default_rng(HELD_OUT_SEED).choice(len(table), count, replace=False)] = True
            self.train_rows, self.eval_rows = np.flatnonzero(~held), np.flatnonzero(held)
            self.eval_table = self.table
            self.eval_tasks = self._eval_tasks

    def tasks(self, seed: int) -> Iterator[Task]:
        return self.tasks_from(seed, 0)

    def tasks_from(self, seed: int, start: int) -> Iterator[Task]:
        """The stream from task `start` on: its pass and place in that pass's order, no row read
        before it."""
        passes, skip = divmod(start, len(self.train_rows))
        while True:
            order = self.train_rows[np.random.default_rng([seed, passes]).permutation(len(self.train_rows))]
            for row, prompt, answer in self._rows(self.table, order[skip:]):
                yield Task(id=f"row{row}-pass{passes}", messages=self._messages(prompt), answer=answer)
            passes, skip = passes + 1, 0

    def _eval_tasks(self, seed: int) -> Iterator[Task]:
        """The held-out rows, each once (set as `eval_tasks` where there is a held-out split)."""
        order = self.eval_rows[np.random.default_rng(seed).permutation(len(self.eval_rows))]
        for row, prompt, answer in self._rows(self.eval_table, order):
            yield Task(id=f"row{row}", messages=self._messages(prompt), answer=answer)

    def reward(self, rollout: Rollout) -> float:
        return self.judge(rollout.completion, rollout.task.answer)

    def _rows(self, table: datasets.Dataset, order: np.ndarray) -> Iterator[tuple[int, Any, Any]]:
        for start in range(0, len(order), READ_BATCH):
            rows = order[start:start + READ_BATCH].tolist()
            batch = table[rows]
            yield from zip(rows, batch[self.prompt_field], batch[self.answer_field])

    def _messages(self, prompt: Any) -> list[dict[str, str]]:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:  # only role and content: a column's other keys are null where a message lacks them
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages
