"""SamplingParams and the per-request Sampler: logits processors, then a seeded draw.

Order, as vLLM and llama.cpp apply them: repetition / presence / frequency penalties and
logit bias on the raw logits; then the structured-output mask (tokens the grammar forbids
go to -inf); then temperature; then top-k, top-p and min-p filtering; then a draw from the
remaining distribution. Temperature 0 is exact argmax.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Sequence

import torch


MAX_LOGPROBS = 20  # the most alternatives a token's logprobs carry (OpenAI's limit)
# What the command line's flags and OpenAI's request bodies (server/openai/) both carry, under these
# names: SamplingParams.from_fields reads them off either
SHARED_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop")


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens, as llama.cpp's repeat penalty
    presence_penalty: float = 0.0  # over output tokens, as OpenAI's
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, not emitted
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep going past end-of-generation tokens (benchmarks)
    skip_special_tokens: bool = True
    # log-probabilities of the model's own distribution (log_softmax of the raw logits, before
    # penalties, mask and temperature), with this many most likely alternatives (0..20)
    logprobs: int | None = None  # for every generated token
    prompt_logprobs: int | None = None  # for every prompt token after the first
    json_schema: dict | None = None  # constrain the output to JSON valid against this schema

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", self.temperature, ">= 0")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", self.top_k, "an integer >= 0 (0 or -1 disables it)")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(all(s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an integer")
        for token, bias in self.logit_bias.items():
            _check(math.isfinite(bias), "logit_bias", {token: bias}, "finite numbers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LOGPROBS)
            _check(ok, name, value, f"None or an integer in [0, {MAX_LOGPROBS}]")
        # the schema itself is compiled (and rejected when invalid) by the engine's add_request
        _check(self.json_schema is None or isinstance(self.json_schema, dict), "json_schema", self.json_schema, "None or a dict")

    @classmethod
    def from_fields(cls, source, **fields) -> SamplingParams:
        """SHARED_FIELDS read off source's attributes (argparse's namespace, a request body), then `fields`:
        the caller's own, or a shared one it derives (a request's max_tokens, a per-choice seed)."""
        return cls(**{name: getattr(source, name) for name in SHARED_FIELDS} | fields)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _check(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter {name}={value!r}: must be {expected}")


class Sampler:
    """Picks one request's tokens. Holds the request's RNG and the token counts penalties need."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: Sequence[int]):
        self.params = params
        self.vocab_size = vocab_size
        for token in list(params.logit_bias) + params.stop_token_ids:
            if not 0 <= token < vocab_size:
                raise ValueError(f"invalid token id {token} in sampling parameters: vocabulary has {vocab_size} tokens")
        self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        # token counts only where a penalty reads them (keeping them costs two tensor ops per token)
        self.counting = params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)
        self.output_counts = torch.zeros(vocab_size if self.counting else 0, dtype=torch.float32)
        self.seen = torch.zeros(vocab_size if self.counting else 0, dtype=torch.bool)  # prompt and output tokens
        if self.counting and len(prompt_ids):
            self.seen[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size)
            for token, value in params.logit_bias.items():
                self.bias[token] = value

    def accept(self, token: int) -> None:
        if self.counting:
            self.output_counts[token] += 1
            self.seen[token] = True

    def __call__(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
        """logits: float32 [vocab] (may be wider than the vocabulary: padding columns are ignored).

        allowed: bool [vocab], the tokens a structured-output grammar permits now (None: all).
        """
        p = self.params
        logits = logits[: self.vocab_size]
        edits = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or self.bias is not None
        if p.greedy and not edits and allowed is None:
            return _argmax(logits)
        logits = logits.clone()  # the steps below edit it in place
        if p.repetition_penalty != 1.0:
            penalized = logits[self.seen]
            logits[self.seen] = torch.where(penalized > 0, penalized / p.repetition_penalty, penalized * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            logits -= p.presence_penalty * (self.output_counts > 0) + p.frequency_penalty * self.output_counts
        if self.bias is not None:
            logits += self.bias
        if allowed is not None:
            logits[~allowed[: self.vocab_size]] = -math.inf
        if p.greedy:
            return _argmax(logits)
        logits /= p.temperature
        if 0 < p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits[logits < kth] = -math.inf
        if p.top_p < 1.0:
            logits[_outside_top_p(logits, p.top_p)] = -math.inf
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0:
            probs[probs < p.min_p * probs.max()] = 0
        # inverse CDF: ~60 us, where torch.multinomial takes ~1 ms over a 49k vocabulary
        cdf = probs.cumsum(0)
        u = torch.rand(1, generator=self.generator) * cdf[-1]
        return int(torch.searchsorted(cdf, u, right=True))  # the first token whose cdf exceeds u


def _argmax(logits: torch.Tensor) -> int:
    """The first index of the maximum. numpy's takes 4 us over a 49k vocabulary, torch.argmax 45 us
    (64 of them per decode step of a full batch)."""
    return int(logits.numpy().argmax())


def _outside_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask of the tokens outside the smallest most-likely set whose probability reaches top_p:
    a token goes when the tokens before it (most likely first) already reach top_p; the first stays.

    Only as many candidates are sorted as the set needs (sorting a 49k vocabulary costs about a
    millisecond per token, a batch's worth of them a whole decode step).
    """
    n = logits.shape[0]
    log_total = torch.logsumexp(logits, dim=0)
    k = min(64, n)
    while True:
        values, ids = torch.topk(logits, k)  # most likely first
        probs = (values - log_total).exp()
        if k == n or float(probs.sum()) >= top_p:  # every token after these k goes
            break
        k = n if k >= 1024 else min(1024, n)
    outside = torch.ones(n, dtype=torch.bool)
    outside[ids[probs.cumsum(0) - probs < top_p]] = False
    return outside
