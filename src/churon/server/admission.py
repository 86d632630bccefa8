"""Admission control (`--max-queue`): how many engine requests may wait for their first token.

Counted here, at admission, rather than read from the scheduler's queue: requests reach the
scheduler a moment after they are admitted, so every request of a burst would pass a look at
the scheduler. Only the event loop touches the count, so it needs no lock.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from churon.server.errors import APIError


class Admission:
    def __init__(self, max_queue: int | None):
        """max_queue: most engine requests admitted and still without their first token; None: no limit."""
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r}: must be >= 1 (or None for no limit)")
        self.max_queue = max_queue
        self.not_started = 0  # engine requests admitted and still without their first token (queued or in prefill)

    @contextmanager
    def admit(self, n: int) -> Iterator[None]:
        """Hold n places while the block runs (until the requests' first tokens); a 503 beyond the limit."""
        if self.max_queue is not None and self.not_started + n > self.max_queue:
            raise APIError(503, f"the server is busy: more than {self.max_queue} requests would wait (--max-queue); retry later",
                           type="service_unavailable", code="queue_full", headers={"Retry-After": "1"})
        self.not_started += n
        try:
            yield
        finally:
            self.not_started -= n
