"""Admission control (`--max-queue`): how many engine requests may wait for their first token.

Counted here, at admission, rather than read from the scheduler's queue: requests reach the
scheduler a moment after they are admitted, so every request of a burst would pass a look at
the scheduler. Only the event loop touches the count, so it needs no lock.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from churon.llm import LLM
from churon.server.errors import APIError


class Admission:
    def __init__(self, max_queue: int | None):
        """max_queue: most engine requests admitted and still without their first token; None: sized from
        the model's KV cache once it is loaded (size_for)."""
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r}: must be >= 1 (or None to size it from the KV cache)")
        self.max_queue = max_queue
        self.not_started = 0  # engine requests admitted and still without their first token (queued or in prefill)

    def size_for(self, llm: LLM) -> None:
        """The default limit, once the model is loaded: as many requests as its KV cache has blocks. Each needs
        a block of its own to start, so of a longer queue some would wait for others to finish, however
        short they are; a client is better told 503 at once, to retry (or go elsewhere), than kept waiting
        for rounds of the batch, its request held in memory meanwhile."""
        if self.max_queue is None:
            engine = llm.engine
            self.max_queue = max(engine.config.max_num_seqs, engine.block_manager.num_blocks)

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
