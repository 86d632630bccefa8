"""What every HTTP request passes before its route: the API key, the body-size limit, and
the count of answers by status code. Plain ASGI, so an oversized body is refused while it
is read, before it is ever held whole in memory.

It also answers a route's unexpected exception (a bug, an engine failure) with its 500 itself.
Starlette's outermost middleware would answer it too, but then re-raise it, and uvicorn closes the
connection of a request whose app raised: the client's next pooled request would fail with it."""

from __future__ import annotations

import hmac
import json
import logging

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from churon.server.errors import error_body_for, is_anthropic_path, server_error_message
from churon.server.metrics import ServerMetrics

log = logging.getLogger("churon.server")

# Liveness probes reach /health without a key (it says only whether the model is loaded), and a browser
# reaches the chat page at / (a static file, where the key is typed); every other path, /metrics included
# (it tells who uses the server how much), needs the key.
OPEN_PATHS = frozenset({"/health", "/"})


class RequestGuard:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests_by_status[message["status"]] += 1
            await send(message)

        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            header = "x-api-key: <key>" if is_anthropic_path(scope["path"]) else "Authorization: Bearer <key>"
            await _error(counting_send, scope, 401, f"invalid or missing API key: send the header '{header}'",
                         "authentication_error", code="invalid_api_key")
            return
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _error(counting_send, scope, 413, self._too_large_message(), code="request_too_large")
            return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # a chunked body, or a Content-Length that lied
                    # FastAPI passes an HTTPException raised while reading the body on to the app's handler
                    raise HTTPException(413, self._too_large_message())
            return message

        try:
            await self.app(scope, limited_receive, counting_send)
        except Exception as e:
            if started:  # a response cut short: the connection has to go, and uvicorn logs why
                raise
            log.exception("%s %s failed", scope["method"], scope["path"])
            await _error(counting_send, scope, 500, server_error_message(e), "server_error")

    def _authorized(self, scope: Scope) -> bool:
        # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key: either opens every path.
        # Compared as the bytes sent (latin-1 gives them back), against the key's UTF-8 bytes.
        bearer = hmac.compare_digest((_header(scope, b"authorization") or "").encode("latin-1"), f"Bearer {self.api_key}".encode())
        x_api_key = hmac.compare_digest((_header(scope, b"x-api-key") or "").encode("latin-1"), self.api_key.encode())
        return bearer or x_api_key

    def _too_large_message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_body_bytes} bytes (--max-body-bytes)"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _error(send: Send, scope: Scope, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None) -> None:
    # written out here: a response sent before the app runs, so no exception handler renders it
    body = json.dumps(error_body_for(scope["path"], status, message, type, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
