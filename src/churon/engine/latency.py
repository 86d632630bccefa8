"""The engine's own record of what its clients wait for: each request's time to first token (arrival to its first
token) and each gap between two consecutive tokens of one request (inter-token latency), over the most recent
requests, with their percentiles. Measured where the tokens leave the engine, so they hold for every front end
(LLM, the server's APIs) and include the time a request waited in the queue.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

PERCENTILES = (50, 90, 95, 99)


class LatencyWindow:
    """The last `size` samples of one latency, in seconds."""

    def __init__(self, size: int):
        self._samples: deque[float] = deque(maxlen=size)
        self.count = 0  # samples since start, the dropped ones included

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self.count += 1

    def percentiles(self) -> dict[int, float]:
        """p -> the nearest-rank p-th percentile of the window (NaN before the first sample)."""
        ordered = sorted(self._samples)
        if not ordered:
            return {p: math.nan for p in PERCENTILES}
        return {p: ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] for p in PERCENTILES}


@dataclass
class LatencySummary:
    """Percentiles (PERCENTILES -> seconds) of the recent requests' times to first token and inter-token latencies,
    and how many of each were measured since start."""

    ttft: dict[int, float]
    itl: dict[int, float]
    ttft_count: int
    itl_count: int


class Latency:
    """Times to first token over the last `requests` requests, inter-token latencies over their last 16x as many
    gaps (the percentiles are sorted when asked for: /metrics, benchmarks)."""

    def __init__(self, requests: int = 2048):
        self.ttft = LatencyWindow(requests)
        self.itl = LatencyWindow(16 * requests)

    def summary(self) -> LatencySummary:
        return LatencySummary(self.ttft.percentiles(), self.itl.percentiles(), self.ttft.count, self.itl.count)
