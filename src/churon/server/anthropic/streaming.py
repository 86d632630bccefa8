"""Anthropic's streaming: server-sent events named by their type (`event: content_block_delta`), in the
order anthropic's MessageStream accumulates them:

    message_start, ping,
    per content block: content_block_start, content_block_delta (text_delta | input_json_delta)..., content_block_stop,
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop

A failure after the status went out is an `error` event in Anthropic's error shape, which its clients raise.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from churon.server.anthropic import render
from churon.server.errors import APIError, anthropic_error_body
from churon.server.generation import Generation
from churon.tokenizer import Tokenizer
from churon.tool_calls import TextDelta, ToolCallArguments, ToolCallStart, ToolPlan

log = logging.getLogger("churon.server")


def sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
        except APIError as e:  # the server's shutdown ended the stream: 503, an overloaded_error its clients retry
            yield f"event: error\ndata: {json.dumps(anthropic_error_body(e.status, e.message, e.param))}\n\n"
        except Exception as e:  # the engine failed mid-stream: the status is sent, so say it in the stream
            log.exception("stream failed")
            yield f"event: error\ndata: {json.dumps(anthropic_error_body(500, str(e)))}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def message_events(generation: Generation, plan: ToolPlan, id: str, model: str, max_tokens: int,
                         stop_sequences: list[str], tokenizer: Tokenizer) -> AsyncIterator[dict[str, Any]]:
    input_tokens = len(generation.requests[0].prompt_ids)
    start = render.message(id, model, [], None, None, render.usage(input_tokens, 0))
    yield {"type": "message_start", "message": start}
    yield {"type": "ping"}
    blocks = _Blocks()
    parser = plan.stream()
    async for _, delta in generation.deltas():
        for event in blocks.feed(parser.feed(delta.text) if delta.text else []):
            yield event
        if delta.finish_reason is not None:
            for event in blocks.feed(parser.finish()):
                yield event
            for event in blocks.close():
                yield event
            output = delta.output
            reason, sequence = render.stop_reason(output, bool(parser.completed), max_tokens, stop_sequences, tokenizer)
            yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": {"output_tokens": len(output.token_ids)}}
    yield {"type": "message_stop"}


class _Blocks:
    """The content blocks of one streamed message: a text block opens at the first text after a tool call (or
    the start), a tool_use block at each call; each closes when the next opens, the last at the end."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # "text" or "tool_use"
        self._tool_blocks: dict[int, int] = {}  # tool call index -> its block's index

    def feed(self, events: list) -> list[dict[str, Any]]:
        out = []
        for e in events:
            if isinstance(e, TextDelta):
                if not e.text:
                    continue
                if self.open != "text":
                    out += self._start("text", render.text_block(""))
                out.append(self._delta(self.index, {"type": "text_delta", "text": e.text}))
            elif isinstance(e, ToolCallStart):
                out += self._start("tool_use", render.tool_use_block(render.tool_use_id(e.id), e.name, {}))
                self._tool_blocks[e.index] = self.index
            elif isinstance(e, ToolCallArguments) and e.fragment:
                out.append(self._delta(self._tool_blocks[e.index], {"type": "input_json_delta", "partial_json": e.fragment}))
        return out

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    @staticmethod
    def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": index, "delta": delta}
