"""Engine outputs in OpenAI's response shapes: chat (with its tool calls) and text completions,
their streaming chunks, usage, and the two logprobs layouts (chat's `content` list, completions'
parallel `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists)."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

from churon.tokenizer import Tokenizer
from churon.tool_calls import TextDelta, ToolCall, ToolCallStart
from churon.tool_calls.tool import StreamEvent

if TYPE_CHECKING:
    from churon.engine import TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class Origin(NamedTuple):
    """Who answers: the response's id, the model as the request named it, and the configuration that decides
    its arithmetic (LLM.fingerprint: two answers with the same one and the same seed are bitwise the same)."""

    id: str
    model: str
    fingerprint: str


def _header(origin: Origin, object: str) -> dict[str, Any]:
    return {"id": origin.id, "object": object, "created": int(time.time()), "model": origin.model,
            "system_fingerprint": origin.fingerprint}


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as text; a token holding part of a UTF-8 character shows U+FFFD (its bytes say the rest)."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


# --- chat ----------------------------------------------------------------------------------


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, token_id), "logprob": logprob, "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def chat_response(origin: Origin, choices: list[dict[str, Any]], usage_: dict[str, int]) -> dict[str, Any]:
    return _header(origin, "chat.completion") | {"choices": choices, "usage": usage_}


def chat_choice(index: int, text: str | None, finish_reason: str, logprobs: dict[str, Any] | None,
                tool_calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = [chat_tool_call(c) for c in tool_calls]
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_stream_delta(event: StreamEvent) -> dict[str, Any]:
    """One parsed piece of a streamed output as a chunk's delta: answer text, a call's start (its id and
    name, arguments "") or the next fragment of its arguments, the way OpenAI streams them."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ToolCallStart):
        function = {"name": event.name, "arguments": ""}
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function", "function": function}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]}


def chat_chunk(origin: Origin, index: int, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _header(origin, "chat.completion.chunk") | {"choices": [choice]}


def with_usage(chunk: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A stream chunk with its choice's usage so far (stream_options.continuous_usage_stats, vLLM's)."""
    return chunk | {"usage": usage(prompt_tokens, completion_tokens)}


def usage_chunk(origin: Origin, object: str, usage_: dict[str, int]) -> dict[str, Any]:
    """The last chunk of a stream with include_usage: no choices, the whole request's usage."""
    return _header(origin, object) | {"choices": [], "usage": usage_}


# --- completions ---------------------------------------------------------------------------


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], text_offset: int = 0
) -> dict[str, Any]:
    """token_ids[i]'s logprob is entries[i]; None (a prompt's first token) gives null logprob and top_logprobs."""
    tokens, offsets, token_logprobs, tops = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
        else:
            token_logprobs.append(entry.logprob)
            # the chosen token is always listed, as OpenAI and vLLM do
            top = {token_text(tokenizer, t): lp for t, lp in entry.top}
            tops.append(top | {text: entry.logprob})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def completion_response(origin: Origin, choices: list[dict[str, Any]], usage_: dict[str, int]) -> dict[str, Any]:
    return _header(origin, "text_completion") | {"choices": choices, "usage": usage_}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(origin: Origin, choice: dict[str, Any]) -> dict[str, Any]:
    return _header(origin, "text_completion") | {"choices": [choice]}
