"""Engine outputs in Anthropic's response shapes (anthropic.types.Message and its content blocks),
and the stop_reason an output ended with."""

from __future__ import annotations

import json
import uuid
from typing import Any, Sequence

from churon.engine import CompletionOutput
from churon.tokenizer import Tokenizer
from churon.tool_calls import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """Anthropic's "toolu_..." ids for churon's "call_..." ones (the same hex)."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use_block(id: str, name: str, input: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": id, "name": name, "input": input}


def content_blocks(text: str | None, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """The answer's text, then its tool calls: the order a stream opens their blocks in."""
    blocks = [text_block(text)] if text else []
    return blocks + [tool_use_block(tool_use_id(c.id), c.name, json.loads(c.arguments)) for c in calls]


def message(id: str, model: str, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
            usage_: dict[str, int]) -> dict[str, Any]:
    return {"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_}


def stop_reason(output: CompletionOutput, tool_calls: bool, max_tokens: int, stop_sequences: Sequence[str],
                tokenizer: Tokenizer) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output. Cut short, it is max_tokens even after a call, as
    Anthropic's: the client must not take the turn for finished."""
    if output.finish_reason == "length":
        # the engine caps max_tokens at what the context window leaves
        return ("max_tokens" if len(output.token_ids) >= max_tokens else "model_context_window_exceeded"), None
    if tool_calls:
        return "tool_use", None
    sequence = _stop_sequence(output, stop_sequences, tokenizer)
    return ("stop_sequence", sequence) if sequence is not None else ("end_turn", None)


def _stop_sequence(output: CompletionOutput, stop_sequences: Sequence[str], tokenizer: Tokenizer) -> str | None:
    """The stop sequence that ended the output, if one did: the output's text stops just before the first one its
    tokens spell (the engine cuts there), so that is the earliest any of them occurs in the tokens' whole text."""
    if not stop_sequences:
        return None
    whole = tokenizer.decode(output.token_ids)
    found = [(at, i) for i, s in enumerate(stop_sequences) if (at := whole.find(s)) >= 0]
    return stop_sequences[min(found)[1]] if found else None
