"""`fleetrl sft`'s data: each row of the table as token ids in the policy's chat template with a
loss mask on the assistant's tokens, and which rows each step trains on.

A row is a conversation (a list of {role, content} messages) or a prompt/completion pair: the
prompt a user message (or a list of messages), the completion the assistant's turn. The chat
template is rendered incrementally, since templates such as SmolLM2's mark no assistant span
(`{% generation %}`): the conversation up to each assistant message with the generation prompt,
then through it; the tokens between the two are that message's, its end-of-turn token included
(what follows the end-of-turn token, a newline, is context). Each rendering must be a token
prefix of the whole conversation's, or the mask would not line up: a template that breaks this
is refused, naming the row.

Step n trains rows (n - 1) x per_step .. n x per_step - 1 of an endless stream that visits every
row once per pass, each pass in its own seeded order: the rows of a step follow from the step
number and the seed alone, so every rank picks them itself and a resume picks them again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
import numpy as np

from fleetrl.config import SftConfig
from fleetrl.errors import FleetrlError


@dataclass(frozen=True)
class Sequence:
    """One row rendered: its token ids, and 1 on the tokens the loss sees."""

    token_ids: list[int]
    loss_mask: list[int]


def conversation_tokens(tokenizer, messages: list[dict[str, str]], where: str) -> Sequence:
    """`messages` in the chat template, the loss on every assistant message; FleetrlError
    naming `where` when the template does not render the conversation as a growing prefix."""
    render = lambda upto, opens: tokenizer.apply_chat_template(  # noqa: E731
        messages[:upto], add_generation_prompt=opens, tokenize=True, return_dict=False)
    whole = list(render(len(messages), False))
    mask = [0] * len(whole)
    end_of_turn = tokenizer.eos_token_id
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        opened, closed = (list(render(i, True)) if i else []), list(render(i + 1, False))
        if not opened:
            raise FleetrlError(f"{where}: message 0 is the assistant's: a conversation starts with a system or user "
                               "message (no position predicts the first token)")
        if closed[:len(opened)] != opened or whole[:len(closed)] != closed:
            raise FleetrlError(f"{where}: the chat template renders the conversation up to message {i} differently "
                               "from its start in the whole conversation: the assistant's tokens cannot be told "
                               "apart (render each conversation as a growing prefix, or mark the assistant's turns "
                               "with {% generation %})")
        turn = closed[len(opened):]
        if end_of_turn in turn:  # the end-of-turn token is trained; what the template adds after it is not
            turn = turn[:len(turn) - turn[::-1].index(end_of_turn)]
        mask[len(opened):len(opened) + len(turn)] = [1] * len(turn)
    return Sequence(whole, mask)


class SftData:
    """The table `sft.path` names, rendered row by row on demand; `check` renders them all."""

    def __init__(self, config: SftConfig, tokenizer, seed: int) -> None:
        from fleetrl.data_files import check_fields, load_table

        if config.path is None:
            raise FleetrlError("fleetrl sft needs its data: set sft.path (a .jsonl, .json, .parquet or .csv file, or "
                               "a folder that `datasets` saved)")
        self.config = config
        self.tokenizer = tokenizer
        self.seed = seed
        self.path = config.path
        self.table = load_table(self.path, config.split)
        columns = set(self.table.column_names)
        if config.messages_field in columns:
            self.kinds = check_fields(self.table, self.path, {config.messages_field: "messages"})
        elif {config.prompt_field, config.completion_field} <= columns:
            self.kinds = check_fields(self.table, self.path, {config.prompt_field: ("text", "messages"),
                                                              config.completion_field: "text"})
        else:
            raise FleetrlError(f"{self.path}: no field '{config.messages_field}' (sft.messages_field), nor both "
                               f"'{config.prompt_field}' and '{config.completion_field}' (sft.prompt_field, "
                               f"sft.completion_field); its fields: {', '.join(self.table.column_names)}")

    def __len__(self) -> int:
        return len(self.table)

    def sequence(self, row: int) -> Sequence:
        """Row `row` rendered; FleetrlError naming the file, the row and the field at fault."""
        record = self.table[row]
        first = next(iter(self.kinds))
        where = f"{self.path} row {row}: field '{first}'"
        messages = record[first]
        if self.kinds[first] == "text":  # a prompt/completion pair's prompt as one user message
            messages = [{"role": "user", "content": messages}]
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if len(self.kinds) == 2:
            messages.append({"role": "assistant", "content": record[self.config.completion_field]})
        if not any(m["role"] == "assistant" for m in messages):
            raise FleetrlError(f"{where}: no assistant message to train on")
        sequence = conversation_tokens(self.tokenizer, messages, where)
        if len(sequence.token_ids) > self.config.max_tokens:
            raise FleetrlError(f"{self.path} row {row}: {len(sequence.token_ids)} tokens in the chat template, more "
                               f"than sft.max_tokens = {self.config.max_tokens}")
        return sequence

    def check(self) -> None:
        """Every row renders and fits, or the first that does not is named."""
        for row in range(len(self)):
            self.sequence(row)

    def step_rows(self, step: int) -> list[int]:
        """The rows step `step` (from 1) trains on."""
        per_step = self.config.sequences_per_step
        return [int(self._order(position // len(self))[position % len(self)])
                for position in range((step - 1) * per_step, step * per_step)]

    def step_sequences(self, step: int) -> list[Sequence]:
        return [self.sequence(row) for row in self.step_rows(step)]

    @functools.lru_cache(maxsize=2)  # noqa: B019 (one SftData per run: the cache lives as long as it)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self))
