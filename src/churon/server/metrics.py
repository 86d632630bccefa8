"""The server's Prometheus metrics, written in the text exposition format by hand.

Counters and histograms the server itself observes (requests by status code, tokens, time
to first token, inter-token latency, embedding requests and their tokens), plus what is read from the engine at scrape time
(running and waiting requests, KV-cache usage, prefix-cache hit rate, preemptions; speculative decoding's proposed
and accepted tokens, verifications, acceptance rate and mean accepted length, all 0 without speculation).
Format: https://prometheus.io/docs/instrumenting/exposition_formats/
"""

from __future__ import annotations

import bisect
import math
from collections import Counter

from churon.engine import EngineStats

# seconds; the spread a CPU engine shows, from a fast decode step to a long queue
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is the +Inf bucket's own share
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets + (math.inf,), self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        out.append(f"{name}_sum {_number(self.sum)}")
        out.append(f"{name}_count {cumulative}")
        return out


class ServerMetrics:
    """What the routes observe. Only the event loop touches it, so it needs no lock."""

    def __init__(self):
        self.requests_by_status: Counter[int] = Counter()
        self.requests_finished: Counter[str] = Counter()  # engine requests by finish reason ("abort": the client left)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()
        self.embedding_requests = 0  # /v1/embeddings requests answered with their vectors
        self.embedding_tokens = 0  # the tokens those requests' inputs came to

    def render(self, engine_stats: EngineStats | None) -> str:
        """The exposition text; engine_stats (AsyncLLMEngine.stats()) is None while the model loads."""
        lines: list[str] = []

        def family(name: str, kind: str, help: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}", *samples])

        family("churon_requests_total", "counter", "HTTP requests answered, by status code.",
               [f'churon_requests_total{{code="{code}"}} {n}' for code, n in sorted(self.requests_by_status.items())])
        family("churon_request_finished_total", "counter", "Engine requests finished, by reason (abort: the client left).",
               [f'churon_request_finished_total{{finished_reason="{r}"}} {n}' for r, n in sorted(self.requests_finished.items())])
        family("churon_prompt_tokens_total", "counter", "Prompt tokens of the requests run.",
               [f"churon_prompt_tokens_total {self.prompt_tokens}"])
        family("churon_generation_tokens_total", "counter", "Tokens generated.",
               [f"churon_generation_tokens_total {self.generation_tokens}"])
        family("churon_time_to_first_token_seconds", "histogram", "From a request's arrival to its first token.",
               self.time_to_first_token.lines("churon_time_to_first_token_seconds"))
        family("churon_inter_token_latency_seconds", "histogram", "Between two consecutive tokens of one request.",
               self.inter_token_latency.lines("churon_inter_token_latency_seconds"))
        family("churon_embedding_requests_total", "counter", "Embedding requests answered with their vectors.",
               [f"churon_embedding_requests_total {self.embedding_requests}"])
        family("churon_embedding_tokens_total", "counter", "Input tokens of the embedding requests answered.",
               [f"churon_embedding_tokens_total {self.embedding_tokens}"])
        if engine_stats is not None:
            s = engine_stats
            family("churon_num_requests_running", "gauge", "Requests in the running batch.",
                   [f"churon_num_requests_running {s.running}"])
            family("churon_num_requests_waiting", "gauge", "Requests queued for the running batch.",
                   [f"churon_num_requests_waiting {s.waiting}"])
            family("churon_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks held by requests (0..1).",
                   [f"churon_kv_cache_usage_ratio {_number(s.kv_cache_usage)}"])
            family("churon_prefix_cache_hit_rate", "gauge", "Prefix-cache hits over looked-up prompt tokens since start.",
                   [f"churon_prefix_cache_hit_rate {_number(s.prefix_cache_hit_rate)}"])
            family("churon_num_preemptions_total", "counter", "Requests preempted to free KV-cache blocks.",
                   [f"churon_num_preemptions_total {s.preemptions}"])
            family("churon_spec_proposed_tokens_total", "counter", "Tokens speculative decoding proposed.",
                   [f"churon_spec_proposed_tokens_total {s.spec_proposed_tokens}"])
            family("churon_spec_accepted_tokens_total", "counter", "Proposed tokens the model accepted.",
                   [f"churon_spec_accepted_tokens_total {s.spec_accepted_tokens}"])
            family("churon_spec_verifications_total", "counter", "Steps of a request that scored proposed tokens.",
                   [f"churon_spec_verifications_total {s.spec_verifications}"])
            family("churon_spec_acceptance_rate", "gauge", "Accepted over proposed tokens since start (0..1).",
                   [f"churon_spec_acceptance_rate {_number(s.spec_acceptance_rate)}"])
            family("churon_spec_mean_accepted_length", "gauge",
                   "Tokens a verification produced on average, its accepted proposals and the model's own (1: no gain).",
                   [f"churon_spec_mean_accepted_length {_number(s.spec_mean_accepted_length)}"])
            if s.latency is not None:  # the engine's own percentiles over its recent requests (engine/latency.py)
                for name, what, values, count in (
                        ("ttft", "time to first token", s.latency.ttft, s.latency.ttft_count),
                        ("itl", "inter-token latency", s.latency.itl, s.latency.itl_count)):
                    metric = f"churon_engine_{name}_seconds"
                    family(metric, "summary", f"The engine's {what} over its recent requests, queueing included.",
                           [f'{metric}{{quantile="{p / 100}"}} {_number(v)}' for p, v in values.items()]
                           + [f"{metric}_count {count}"])
        return "\n".join(lines) + "\n"


def _number(x: float) -> str:
    if x == math.inf:
        return "+Inf"
    if x != x:
        return "NaN"  # a summary's quantile before its first sample
    return repr(float(x)) if isinstance(x, float) else str(x)
