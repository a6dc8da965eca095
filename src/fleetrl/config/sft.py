"""`[sft]`: the data of `fleetrl sft`, its columns, the rows of each step and the longest row."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from fleetrl.config.section import Section


class SftConfig(Section):
    """`fleetrl sft`: supervised training on conversations, the loss on the assistant's tokens
    (the model, the optimizer, the steps and the run directory are trainer.*, model.* and run.*)."""

    path: Path | None = Field(
        None, description="The training data: a local .jsonl, .json, .parquet or .csv file, or a folder that "
        "`datasets` saved (save_to_disk). Each row is a conversation (sft.messages_field) or a prompt/completion "
        "pair (sft.prompt_field and sft.completion_field), whichever columns the table has.")
    split: str | None = Field(None, description="The split to read from a saved DatasetDict folder; unset = its "
                              "'train' split, else its only split.")
    messages_field: str = Field(
        "messages", min_length=1, description="The column of conversations: lists of {role, content} messages; "
        "every assistant message is trained on (its tokens and its end-of-turn token), the rest is context.")
    prompt_field: str = Field(
        "prompt", min_length=1, description="Without a messages column: the prompt's column, a string (rendered "
        "as one user message) or a list of messages, followed by the completion as the assistant's turn.")
    completion_field: str = Field("completion", min_length=1,
                                  description="Without a messages column: the completion's column, a string.")
    sequences_per_step: int = Field(
        32, ge=1, description="Rows per optimizer step, drawn in a seeded order (run.seed) that is reshuffled each "
        "pass over the data; run.max_steps x this / the rows = the epochs. The loss is the mean NLL over the "
        "step's assistant tokens.")
    max_tokens: int = Field(
        1024, ge=2, description="The longest row, rendered in the chat template, in tokens: a longer one is "
        "refused at the start (naming its file and row), never truncated. At most trainer.micro_batch_tokens.")
