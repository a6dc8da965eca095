"""Tools a multi-turn environment lends the model, and the tool calls read from its turns. A tool
is a plain Python callable with a name, a JSON-schema of its arguments and a time limit, whose
text the model reads back; calls are read in the Hermes `<tool_call>` format. A call the model
wrote badly is answered with a `tool` message naming the mistake; a tool that raises or runs past
its limit ends the episode. docs/environments.md, "A tool"."""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# One Hermes tool call; its group is the call's JSON.
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., object]  # called with the call's arguments as keywords; returns the text read back
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout_s: float = 10.0  # past this the tool is given up on and the episode ends

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates render tools from."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None  # why the call cannot be made (the model wrote it badly)


def parse_tool_calls(text: str, tools: dict[str, Tool]) -> list[ToolCall]:
    """The tool calls in one model turn, in order; a badly written call carries its `error`."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({e.msg})"))
            continue
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if not isinstance(name, str) or name not in tools:
            calls.append(ToolCall(str(name), {}, f"no tool named {name!r} (tools: {', '.join(tools)})"))
        elif not isinstance(arguments, dict):
            calls.append(ToolCall(name, {}, f"the arguments of {name} are not a JSON object"))
        else:
            try:
                inspect.signature(tools[name].fn).bind(**arguments)
            except TypeError as e:
                calls.append(ToolCall(name, arguments, f"bad arguments for {name}: {e}"))
                continue
            calls.append(ToolCall(name, arguments))
    return calls
