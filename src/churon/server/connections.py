"""The HTTP connections under the app: read deadlines and a connection limit, on uvicorn's own protocol.

uvicorn bounds only the idle time after a response (timeout_keep_alive): a connection that never sends
its first request, or sends its headers or body a byte at a time, stays open for good, each holding a
file descriptor, until the process runs out of them and its accept loop fails for everyone. So, per
connection, as nginx's client_header_timeout and client_body_timeout (here whole-message deadlines,
which no trickle of bytes extends):

    header_timeout  from the connection's start, or a later request's first byte, to its complete
                    headers; past it the connection is closed (between requests, uvicorn's
                    keep-alive timeout closes an idle connection)
    body_timeout    from the headers to the body's end; past it a 408, and the connection is closed

and a request's head is at most MAX_HEAD_BYTES (past it a 431: httptools, unlike h11, sets no bound,
so headers sent fast enough would grow in memory until the header timeout);
and, over all of them, max_connections: a connection beyond it is answered 503 at once and closed,
which keeps the descriptors in use below the process's file limit (serve.py sets both).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

MAX_HEAD_BYTES = 64 << 10  # a request line and headers; nginx's default buffers hold 32 KiB, h11's 16 KiB


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections: int | None = None  # None: no limit of churon's own

    def __post_init__(self):
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be > 0 seconds")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections!r}: must be >= 1")


def _response(status: bytes, message: str, *headers: bytes) -> bytes:
    body = message.encode()
    head = [b"HTTP/1.1 " + status, b"content-type: text/plain; charset=utf-8", b"connection: close",
            b"content-length: " + str(len(body)).encode(), *headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class GuardedHTTPProtocol(AutoHTTPProtocol):  # uvicorn's httptools protocol where installed, else its h11 one
    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._refused = False
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting = ""  # what the deadline waits for: "head" or "body"
        self._reading: Any = None  # the request cycle whose head has been read
        self._head_bytes = 0  # received while awaiting a head

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limit = self.limits.max_connections
        if limit is not None and len(self.connections) >= limit:
            self._refused = True
            transport.write(_response(b"503 Service Unavailable", f"the server is at its limit of {limit} connections"
                                      " (--max-connections); retry later\n", b"retry-after: 1"))
            transport.close()
            return
        super().connection_made(transport)
        self._await("head", self.limits.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:  # never made: nothing of uvicorn's to tear down
            return
        self._cancel_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._await("head", self.limits.header_timeout, self._head_timed_out)  # a next request's first bytes
        if self._awaiting == "head":
            self._head_bytes += len(data)
        super().data_received(data)
        cycle = self.cycle
        if self.transport.is_closing():
            return
        if self._awaiting == "head" and cycle is self._reading and self._head_bytes > MAX_HEAD_BYTES:
            self.transport.write(_response(b"431 Request Header Fields Too Large",
                                           f"the request's headers are larger than {MAX_HEAD_BYTES} bytes\n"))
            self.transport.close()
            return
        if cycle is None:
            return
        if cycle is not self._reading:  # a request's head is complete: its body's deadline replaces the head's
            self._reading = cycle
            self._cancel_deadline()
            if cycle.more_body:
                self._await("body", self.limits.body_timeout, self._body_timed_out, cycle)
        elif self._awaiting == "body" and not cycle.more_body:
            self._cancel_deadline()

    def _await(self, what: str, seconds: float, callback, *args: Any) -> None:
        self._cancel_deadline()
        self._awaiting, self._head_bytes = what, 0
        self._deadline = self.loop.call_later(seconds, callback, *args)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline, self._awaiting = None, ""

    def _head_timed_out(self) -> None:
        self._deadline, self._awaiting = None, ""
        if not self.transport.is_closing():
            self.transport.close()

    def _body_timed_out(self, cycle: Any) -> None:
        self._deadline, self._awaiting = None, ""
        if self.transport.is_closing():
            return
        if not cycle.response_started:
            self.transport.write(_response(b"408 Request Timeout", f"the request body did not arrive within"
                                           f" {self.limits.body_timeout:g} s (--body-timeout)\n"))
        self.transport.close()  # the app reading the body sees the client gone
