"""Conversations as token ids, in the policy's chat template, without ever re-tokenizing a turn.

A multi-turn episode grows one turn at a time: the model's tokens are kept exactly as sampled,
and only what the environment adds is rendered. Rendering the whole conversation again from its
text would not do: the text of a model turn does not always tokenize back to the tokens the
model produced, and the trainer would then score tokens the policy never sampled (drift).

What lies between two model turns is read off the template itself, once, from a probe
conversation: the tokens that close an assistant turn (for ChatML, `<|im_end|>` and a newline),
then the new messages, then the opening of the next assistant turn. A model turn that already
ends with part of the closing (the end-of-turn token it stopped on) is not given it twice.
"""

from __future__ import annotations

from typing import Any

from fleetrl.errors import FleetrlError

_PROBE = [{"role": "user", "content": "x"}]
_PROBE_REPLY = {"role": "assistant", "content": "y"}


def render_prompt(tokenizer, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A prompt's token ids: chat messages (and tool schemas, for templates that render them)
    in the policy's chat template, ready for its reply."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


class ChatTokens:
    """The token ids the chat template puts between two model turns."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        opened = self._render(_PROBE, opens_reply=True)
        self._closed = self._render([*_PROBE, _PROBE_REPLY], opens_reply=False)
        reply = tokenizer.encode(_PROBE_REPLY["content"], add_special_tokens=False)
        if self._closed[: len(opened)] != opened or self._closed[len(opened) : len(opened) + len(reply)] != reply:
            raise FleetrlError("the policy's chat template does not render an assistant turn as its opening then "
                               "its content: fleetrl cannot extend its conversations token by token")
        self.closing = self._closed[len(opened) + len(reply) :]  # what ends an assistant turn
        self.between_turns([], [{"role": "user", "content": "z"}])  # a template that rewrites turns fails here

    def between_turns(self, model_ids: list[int], messages: list[dict[str, str]]) -> list[int]:
        """The tokens after a model turn `model_ids`: the rest of its closing, `messages`
        rendered, and the opening of the model's next turn."""
        full = self._render([*_PROBE, _PROBE_REPLY, *messages], opens_reply=True)
        if full[: len(self._closed)] != self._closed:
            raise FleetrlError(f"the policy's chat template renders the conversation before the messages "
                               f"{[m['role'] for m in messages]} differently once they follow: fleetrl cannot "
                               "extend its conversations token by token")
        said = next(j for j in range(len(self.closing), -1, -1)
                    if j == 0 or model_ids[-j:] == self.closing[:j])
        return self.closing[said:] + full[len(self._closed) :]

    def _render(self, messages: list[dict[str, str]], opens_reply: bool) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=opens_reply, tokenize=True,
                                                  return_dict=False)
