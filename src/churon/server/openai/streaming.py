"""OpenAI's streaming: server-sent events, one `data:` line of JSON per chunk, then `data: [DONE]`
(chat and completions), or each event named by an `event:` line and no [DONE] (the Responses API)."""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from churon.server.errors import APIError, error_body

log = logging.getLogger("churon.server")


def sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except APIError as e:  # the server's shutdown ended the stream (drain.py)
            yield f"data: {json.dumps(error_body(e.message, e.type, e.param, e.code))}\n\n"
        except Exception as e:  # the engine failed mid-stream: the status is sent, so say it in the stream
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def named_sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Each event under its `type` as the SSE event name, as the Responses API streams; the stream just
    ends, no [DONE]. A failure mid-stream is the producer's to report (Responses: response.failed)."""

    async def body():
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
