"""What the engine hands back: a request's CompletionOutput, the Delta each step adds to it,
token log-probabilities, and timing Metrics.

Log-probabilities are those of the model's own distribution, log_softmax of the raw logits (before
penalties, the structured-output mask and temperature), as vLLM reports by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from churon.engine.latency import LatencySummary


@dataclass
class Metrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    prefill_seconds: float = 0.0  # arrival to first token: the time to first token
    decode_seconds: float = 0.0  # first token to last

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first token comes out of prefill; the rest each cost one decode step
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first; len == the requested number


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """logits: float32 [n, vocab] raw rows; for row i, the logprob of token_ids[i] and the num_top most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(token_ids)), torch.as_tensor(list(token_ids), dtype=torch.long)].tolist()
    top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return [
        TokenLogprob(token, value, list(zip(ids, values)))
        for token, value, ids, values in zip(token_ids, chosen, top_ids.tolist(), top_values.tolist())
    ]


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]  # generated, the stop token that ended the request included (as vLLM's): it adds no text
    finish_reason: str | None  # "stop", "length", "abort" or "error" (see error); None while running
    prompt_token_ids: list[int]
    metrics: Metrics = field(default_factory=Metrics)
    request_id: int = -1
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when params.logprobs is set
    # one per prompt token (the first has none: None), when params.prompt_logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # why the request failed, with finish_reason "error" (as vLLM's: the others went on)


@dataclass
class Delta:
    """What one step adds to a request: new text (possibly empty while a UTF-8 sequence or a possible stop string is pending)."""

    request_id: int
    text: str
    token_id: int | None
    finish_reason: str | None  # set on the request's last delta
    output: CompletionOutput  # the request so far (shared and updated by later steps: read finish_reason above)
    logprob: TokenLogprob | None = None  # token_id's, when params.logprobs is set


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's counters (the server's /metrics gauges)."""

    running: int
    waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests (0..1)
    prefix_cache_hit_rate: float  # prefix-cache hits over looked-up prompt tokens since start
    prefix_cache_hit_blocks: int
    prefix_cache_miss_blocks: int
    preemptions: int
    latency: LatencySummary | None = None  # the recent requests' TTFT and inter-token latency percentiles
    # speculative decoding (engine/speculative/), since start: tokens proposed and accepted, and verifications (a
    # request's steps that scored at least one proposed token); all 0 without speculation
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted proposed tokens over proposed ones (0 before any)."""
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verification produced on average: its accepted proposals plus the token the target drew itself
        (1 is no gain; 0 before any verification)."""
        return 1 + self.spec_accepted_tokens / self.spec_verifications if self.spec_verifications else 0.0
