"""An Anthropic request's conversation -> the neutral one churon.tool_calls renders, and its prompt.

Anthropic's content blocks map onto the chat-template messages tool calling shares with OpenAI's API:
`system` (a string or text blocks) is a system message; a user turn's tool_result blocks are `tool`
messages, in order, before the turn's text; an assistant turn's text and tool_use blocks are one
assistant message with its tool_calls; thinking blocks sent back from earlier turns are dropped (the
template never saw them). A final assistant message is a prefill: the answer continues its text.

Every neutral message remembers the Anthropic field it came from, so a ToolCallError about
"messages[4].tool_call_id" is reported as "messages.3.content.0.tool_use_id".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from churon.errors import ContextLengthError
from churon.llm import LLM
from churon.server.anthropic.protocol import (
    CountTokensRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from churon.server.errors import APIError
from churon.server.offload import build_plan, off_loop
from churon.tool_calls import Tool, ToolCallError, ToolChoice, ToolPlan

_CHOICE_MODES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


@dataclass
class Conversation:
    messages: list[dict[str, Any]] = field(default_factory=list)  # Hugging Face chat-template form
    prefill: str | None = None  # a final assistant message's text
    paths: dict[str, str] = field(default_factory=dict)  # neutral input path -> the Anthropic field it came from

    def add(self, message: dict[str, Any], path: str) -> None:
        self.paths[f"messages[{len(self.messages)}]"] = path
        self.messages.append(message)

    def anthropic_param(self, neutral: str) -> str:
        """The Anthropic field a neutral path ("messages[4].tool_call_id", "tools[0].parameters") names; paths
        whose fields keep their names ("tools[1].name", "tool_choice") only change notation."""
        for key in sorted(self.paths, key=len, reverse=True):
            if neutral == key or neutral.startswith(key) and neutral[len(key)] in ".[":
                return self.paths[key] + _dotted(neutral[len(key):])
        return _dotted(neutral)


@dataclass
class Prompt:
    plan: ToolPlan
    ids: list[int]  # the plan's, and a prefill's


async def build_prompt(llm: LLM, body: CountTokensRequest) -> Prompt:
    """The request's prompt ids, through the model's chat template (off the event loop), with its tools' plan;
    a 400 naming the field for a conversation, tool or tool_choice churon cannot take."""
    conversation = read_conversation(body)
    tools = [Tool(t.name, t.description, t.input_schema) for t in body.tools or []]
    conversation.paths |= {f"tools[{i}].parameters": f"tools.{i}.input_schema" for i in range(len(tools))}
    conversation.paths["json_schema"] = "output_config.format.schema"
    choice, parallel = _tool_choice(body)
    json_schema = body.output_config.format.schema_ if body.output_config and body.output_config.format else None
    try:
        plan = await build_plan(llm, conversation.messages, tools, choice, parallel=parallel, json_schema=json_schema)
    except ToolCallError as e:  # its message names the neutral field: name Anthropic's instead
        param = conversation.anthropic_param(e.param)
        raise APIError(400, str(e).replace(e.param, param), param=param)
    ids = list(plan.prompt_ids)
    if conversation.prefill is not None:
        if plan.grammar is not None:
            raise APIError(400, "a final assistant message (prefill) cannot be combined with a forced tool_choice or"
                           " output_config.format: the answer must start from scratch", param=f"messages.{len(body.messages) - 1}")
        try:
            ids += await off_loop(llm.encode, conversation.prefill, add_bos=False)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=f"messages.{len(body.messages) - 1}")
    return Prompt(plan, ids)


def read_conversation(body: CountTokensRequest) -> Conversation:
    conversation = Conversation()
    if body.system:
        conversation.add({"role": "system", "content": _text(body.system)}, "system")
    tool_names: dict[str, str] = {}  # tool_use id -> the tool's name, for the tool_result answering it
    last = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        path = f"messages.{i}"
        if message.role == "assistant" and i == last and _is_prefill(message.content):
            conversation.prefill = _text([b for b in message.content if isinstance(b, TextBlock)])
        elif message.role == "assistant":
            _assistant(conversation, message.content, path, tool_names)
        else:
            _user(conversation, message.content, path, tool_names)
    return conversation


def _assistant(conversation: Conversation, blocks: list, path: str, tool_names: dict[str, str]) -> None:
    texts, calls = [], []
    index = len(conversation.messages)
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            call = f"messages[{index}].tool_calls[{len(calls)}]"
            conversation.paths |= {call: f"{path}.content.{j}", f"{call}.function": f"{path}.content.{j}",
                                   f"{call}.function.arguments": f"{path}.content.{j}.input"}
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}})
            tool_names[block.id] = block.name
        elif isinstance(block, ToolResultBlock):
            raise APIError(400, f"{path}.content.{j}: tool_result blocks belong in user messages, after the"
                           " assistant message with their tool_use", param=f"{path}.content.{j}")
        # thinking and redacted_thinking: the earlier turn's reasoning, not part of the rendered conversation
    message: dict[str, Any] = {"role": "assistant", "content": _text(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    conversation.add(message, path)


def _user(conversation: Conversation, blocks: list, path: str, tool_names: dict[str, str]) -> None:
    texts = []
    for j, block in enumerate(blocks):
        block_path = f"{path}.content.{j}"
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in tool_names:
                raise APIError(400, f"{block_path}.tool_use_id: no earlier assistant message has a tool_use block with"
                               f" the id {block.tool_use_id!r}", param=f"{block_path}.tool_use_id")
            # is_error has no place in chat templates; the result's text is what says what went wrong
            conversation.add({"role": "tool", "content": _text(block.content), "tool_call_id": block.tool_use_id,
                              "name": tool_names[block.tool_use_id]}, block_path)
            conversation.paths[f"messages[{len(conversation.messages) - 1}].tool_call_id"] = f"{block_path}.tool_use_id"
        elif isinstance(block, TextBlock):
            texts.append(block)
        else:
            raise APIError(400, f"{block_path}: {block.type} blocks belong in assistant messages", param=block_path)
    if texts:
        conversation.add({"role": "user", "content": _text(texts)}, path)


def _is_prefill(blocks: list) -> bool:
    """Text (and the reasoning before it) to continue; a final assistant message with tool calls is a finished turn."""
    return not any(isinstance(b, (ToolUseBlock, ToolResultBlock)) for b in blocks) and any(
        isinstance(b, TextBlock) and b.text for b in blocks)


def _tool_choice(body: CountTokensRequest) -> tuple[ToolChoice, bool]:
    c = body.tool_choice
    if c is None:
        return ToolChoice("auto"), True
    if c.type == "tool" and c.name is None:
        raise APIError(400, "tool_choice.name: required when tool_choice.type is 'tool'", param="tool_choice.name")
    if c.type != "tool" and c.name is not None:
        raise APIError(400, f"tool_choice.name: only tool_choice.type 'tool' names a tool, not {c.type!r}",
                       param="tool_choice.name")
    # said here in Anthropic's words; churon.tool_calls checks the same in OpenAI's ("required", "function")
    if c.type in ("any", "tool") and not body.tools:
        raise APIError(400, f"tool_choice.type {c.type!r} needs tools", param="tool_choice")
    if c.type == "tool" and c.name not in {t.name for t in body.tools}:
        raise APIError(400, f"tool_choice.name {c.name!r} is not among the tools", param="tool_choice.name")
    return ToolChoice(_CHOICE_MODES[c.type], c.name), not c.disable_parallel_tool_use


def _text(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _dotted(path: str) -> str:
    """A neutral path in Anthropic's notation: "tools[0].x" -> "tools.0.x"."""
    return re.sub(r"\[(\d+)\]", r".\1", path)
