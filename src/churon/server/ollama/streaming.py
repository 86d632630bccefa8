"""Ollama's streaming: newline-delimited JSON, one object a line (application/x-ndjson), the last one
`done: true` (chat, generate) or {"status": "success"} (pull, create). A failure after the status went out
is one {"error": "..."} line, which the ollama clients raise as a ResponseError.

respond() answers a request's `stream` flag: the stream, or (stream: false) the last object alone; a
failure before that object is then a plain error response with its status."""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from churon.server.errors import APIError, ollama_error_body

log = logging.getLogger("churon.server")


def ndjson(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield json.dumps(event, ensure_ascii=False) + "\n"
        except APIError as e:  # the server's shutdown ended the stream (drain.py), or a step that failed late
            yield json.dumps(ollama_error_body(e.message)) + "\n"
        except Exception as e:  # the engine failed mid-stream: the status is sent, so say it in the stream
            log.exception("stream failed")
            yield json.dumps(ollama_error_body(str(e))) + "\n"

    return StreamingResponse(body(), media_type="application/x-ndjson")


async def last(events: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """The last object of a stream (stream: false): the final one of pull and create."""
    final = None
    async for event in events:
        final = event
    return final


async def respond(stream: bool, events: AsyncIterator[dict[str, Any]]) -> Response:
    if stream:
        return ndjson(events)
    return JSONResponse(await last(events))
