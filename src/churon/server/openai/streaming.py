"""OpenAI's streaming: server-sent events, one `data:` line of JSON per chunk, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from churon.server.errors import error_body

log = logging.getLogger("churon.server")


def sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except Exception as e:  # the engine failed mid-stream: the status is sent, so say it in the stream
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
