"""Graceful shutdown (SIGTERM): stop admitting, give running requests a grace period, then end them.

While draining, every new request is a 503 (state.ready(), /health included, so a load balancer stops
sending). The requests already running go on for up to --shutdown-timeout seconds; then each that has
not finished is ended: its engine requests aborted, a response not yet started answered 503, a stream
closed with its dialect's final error event (OpenAI's then `data: [DONE]`, Anthropic's `error`, the
Responses API's `response.failed`), never cut mid-event. Only the event loop touches a Drain.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from churon.server.errors import APIError


class Endable(Protocol):
    def end(self, error: BaseException) -> None: ...


class Drain:
    def __init__(self):
        self.draining = False
        self._why = ""  # when what still ran was ended
        self.expired = asyncio.Event()  # the grace period is over: what still runs is ended
        self._running: set[Endable] = set()  # streams started, still being sent

    def begin(self, timeout: float) -> None:
        """Stop admitting; end what still runs `timeout` seconds from now. Called on the event loop."""
        if self.draining:
            return
        self.draining = True
        asyncio.get_running_loop().call_later(timeout, self.expire, f"after the grace period of {timeout:g} s"
                                              " (--shutdown-timeout)")

    def expire(self, why: str = "at a second signal") -> None:
        """End every running request now: the grace period is over, or a second signal came."""
        if self.expired.is_set():
            return
        self._why = why
        self.expired.set()
        for running in list(self._running):
            running.end(self.error())

    def error(self) -> APIError:
        return APIError(503, f"the server is shutting down: this request was ended {self._why}; retry it",
                        type="service_unavailable", code="server_shutting_down", headers={"Retry-After": "1"})

    def refusing(self) -> APIError | None:
        """The 503 a new request gets while draining; None while serving."""
        if not self.draining:
            return None
        return APIError(503, "the server is shutting down: it takes no new requests", type="service_unavailable",
                        code="server_shutting_down", headers={"Retry-After": "1"})

    def track(self, running: Endable) -> None:
        if self.expired.is_set():
            running.end(self.error())
        else:
            self._running.add(running)

    def untrack(self, running: Endable) -> None:
        self._running.discard(running)
