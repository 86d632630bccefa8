"""The neutral tool-calling vocabulary every API maps its own request and response shapes onto:
a Tool (a function and its arguments' JSON schema), the ToolChoice (OpenAI's auto / none / required /
a named function), a parsed ToolCall, and ToolCallError, whose `param` names the input field at fault."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from churon.errors import ChuronError

# OpenAI's rule for function names (Anthropic's is the same, 1..64 of these characters)
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolCallError(ChuronError, ValueError):
    """Bad tool-calling input. param: the field at fault, as a path into the neutral input
    ("tools[0].parameters", "tool_choice", "messages[3].tool_call_id"), for each API to name in its 400."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON schema; {} or None: no arguments

    def __post_init__(self):
        if not self.parameters:  # OpenAI: "omitting parameters defines a function with an empty parameter list"
            object.__setattr__(self, "parameters", NO_PARAMETERS)

    def as_openai(self) -> dict[str, Any]:
        """The tool as Hugging Face chat templates receive it (OpenAI's function-tool shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None  # mode "function": exactly this tool


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class TextDelta:
    """Answer text (content), in stream order."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins: its index among the output's calls, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """The next piece of call `index`'s arguments (JSON text; the pieces joined are the whole arguments)."""

    index: int
    fragment: str


StreamEvent = TextDelta | ToolCallStart | ToolCallArguments

