"""Anthropic's Messages API request bodies as pydantic models (anthropic.types' *Param shapes).

Field names are Anthropic's. A string where Anthropic allows "a string or a list of text blocks"
(a message's content, `system`, a tool_result's content) is read as one text block before
validation, so a bad block is an error naming its own path, never a guess between union branches.
Content blocks are told apart by `type`; the path of a bad field names the block type, as
Anthropic's own errors do ("messages.0.content.1.tool_result.tool_use_id").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from churon.server.request_model import RequestModel

# prompt caching and citations mean nothing to a local engine: accepted on every block and tool
_CACHING = frozenset({"cache_control", "citations"})


def _text_shorthand(value: Any) -> Any:
    """Anthropic's shorthand: a string is one text block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class TextBlock(RequestModel):
    UNIMPLEMENTED = _CACHING
    type: Literal["text"]
    text: str


class ToolUseBlock(RequestModel):
    """A tool call the assistant made in an earlier turn."""

    UNIMPLEMENTED = _CACHING | {"caller", "toolset_name"}
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(RequestModel):
    """A tool's answer to the tool_use block with id tool_use_id, in the user turn after it."""

    UNIMPLEMENTED = _CACHING | {"toolset_name"}
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] = []
    is_error: bool = False

    _content = field_validator("content", mode="before")(_text_shorthand)


class ThinkingBlock(RequestModel):
    """An earlier turn's reasoning, which clients send back as they got it: accepted, not rendered."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] = Field(min_length=1)

    _content = field_validator("content", mode="before")(_text_shorthand)


class Tool(RequestModel):
    """A client tool (Anthropic's "custom" type); server tools (web search, code execution) are not run here."""

    UNIMPLEMENTED = _CACHING | {"strict", "input_examples", "defer_loading", "allowed_callers", "eager_input_streaming"}
    type: Literal["custom"] | None = None
    name: str  # checked against the tool-name rule by churon.tool_calls
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool" only: the tool that must be called
    disable_parallel_tool_use: bool = False


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    UNIMPLEMENTED = frozenset({"effort"})
    format: OutputFormat | None = None


class CountTokensRequest(RequestModel):
    """POST /v1/messages/count_tokens: the prompt of a Messages request, without its sampling fields."""

    UNIMPLEMENTED = frozenset({
        "thinking", "cache_control", "container", "context_management", "mcp_servers", "speed", "inference_geo",
        "diagnostics", "user_profile_id", "workspace_id",
    })
    model: str
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None

    _system = field_validator("system", mode="before")(_text_shorthand)


class MessagesRequest(CountTokensRequest):
    UNIMPLEMENTED = CountTokensRequest.UNIMPLEMENTED | {"metadata", "service_tier"}
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
