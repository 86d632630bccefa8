"""SamplingParams and the per-request Sampler: logits processors, then a seeded draw.

Order, as vLLM and llama.cpp apply them: repetition / presence / frequency penalties (over the last
repeat_last_n tokens, llama.cpp's window) and logit bias on the raw logits; then the structured-output
mask (tokens the grammar forbids go to -inf); then temperature; then top-k, top-p and min-p filtering;
then a draw from the remaining distribution. Temperature 0 is exact argmax.

No request's parameters can make its distribution non-finite: penalties and biases are bounded, a
temperature below MIN_TEMPERATURE samples at MIN_TEMPERATURE (vLLM's floor) and top-p always keeps
the most likely token. What is left, logits the model itself made NaN or infinite (or a grammar that
allows nothing), raises GenerationError for this request alone (the engine finishes it with "error").
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from churon.errors import GenerationError

MAX_LOGPROBS = 20  # the most alternatives a token's logprobs carry (OpenAI's limit)
# What the command line's flags and OpenAI's request bodies (server/openai/) both carry, under these
# names: SamplingParams.from_fields reads them off either
SHARED_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop")
# Below it, logits / temperature overflows float32 for logits of ordinary size (vLLM's _MAX_TEMP): such a
# temperature is accepted (OpenAI's range is [0, 2]) and samples as this one, all but greedy
MIN_TEMPERATURE = 1e-2
# A penalty divides or multiplies logits: past these the penalized ones overflow or vanish in float32
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
# Far past any use (OpenAI's range, the server's, is [-100, 100]), yet finite in float32 after every
# scaling the sampler applies (a repetition penalty of 100, the temperature floor)
MAX_LOGIT_BIAS = 1e30
# A LoRA adapter's strength (scale * alpha / r multiplies its product): past a few the adapter swamps the base
# model; this bound only keeps a typo (1e9) from making every activation overflow
MAX_LORA_SCALE = 16.0


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
    # the penalties see only the last N tokens of the sequence (prompt and output; presence and frequency still
    # count output tokens only), as Ollama's and llama.cpp's repeat_last_n: 0 disables them, -1 is every token
    repeat_last_n: int = -1
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
    grammar: str | None = None  # or to this Lark grammar (llguidance's dialect; tool calls); not both
    lora: str | None = None  # the name of a loaded LoRA adapter to generate with (None: the base model)
    lora_scale: float = 1.0  # multiplies the adapter's delta (0.5: half its effect, 0: the base model's output)

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
        low, high = REPETITION_PENALTY_RANGE
        _check(_finite(self.repetition_penalty) and low <= self.repetition_penalty <= high, "repetition_penalty",
               self.repetition_penalty, f"in [{low}, {high}]")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(isinstance(self.repeat_last_n, int) and not isinstance(self.repeat_last_n, bool) and self.repeat_last_n >= -1,
               "repeat_last_n", self.repeat_last_n, "an integer >= -1 (0 disables the penalties, -1: every token)")
        _check(all(s for s in self.stop), "stop", self.stop, "non-empty strings")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an integer")
        for token, bias in self.logit_bias.items():
            _check(-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias", {token: bias},
                   f"numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LOGPROBS)
            _check(ok, name, value, f"None or an integer in [0, {MAX_LOGPROBS}]")
        # the schema or grammar itself is compiled (and rejected when invalid) by the engine's add_request
        _check(self.json_schema is None or isinstance(self.json_schema, dict), "json_schema", self.json_schema, "None or a dict")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""), "grammar",
               self.grammar, "None or a non-empty Lark grammar")
        _check(self.json_schema is None or self.grammar is None, "grammar", self.grammar, "None when json_schema is set")
        # the name itself is resolved (and rejected when no adapter of that name is loaded) by the engine's add_request
        _check(self.lora is None or (isinstance(self.lora, str) and self.lora != ""), "lora", self.lora,
               "None or the name of a loaded LoRA adapter")
        _check(_finite(self.lora_scale) and not isinstance(self.lora_scale, bool) and abs(self.lora_scale) <= MAX_LORA_SCALE,
               "lora_scale", self.lora_scale, f"a finite number in [-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}]")

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
        penalties = params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)
        self.counting = penalties and params.repeat_last_n != 0
        # the last repeat_last_n tokens, (token, generated?) each, to take out of the counts as they leave the window
        self.window: deque[tuple[int, bool]] | None = deque() if self.counting and params.repeat_last_n > 0 else None
        self.counts = torch.zeros(vocab_size if self.counting else 0, dtype=torch.float32)  # prompt and output tokens
        self.output_counts = torch.zeros(vocab_size if self.counting else 0, dtype=torch.float32)
        if self.counting:
            recent = list(prompt_ids)[-params.repeat_last_n:] if self.window is not None else list(prompt_ids)
            if recent:
                self.counts += torch.bincount(torch.as_tensor(recent, dtype=torch.long), minlength=vocab_size)[:vocab_size]
            if self.window is not None:
                self.window.extend((token, False) for token in recent)
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size)
            for token, value in params.logit_bias.items():
                self.bias[token] = value

    @property
    def takes_argmax(self) -> bool:
        """The draw is the first maximum of the raw logits (where no grammar restricts them): greedy, no penalty or
        bias."""
        return self.params.greedy and not self.counting and self.bias is None

    def accept(self, token: int) -> None:
        if not self.counting:
            return
        self.counts[token] += 1
        self.output_counts[token] += 1
        if self.window is not None:
            self.window.append((token, True))
            if len(self.window) > self.params.repeat_last_n:
                old, generated = self.window.popleft()
                self.counts[old] -= 1
                if generated:
                    self.output_counts[old] -= 1

    def __call__(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
        """logits: float32 [vocab] (may be wider than the vocabulary: padding columns are ignored).

        allowed: bool [vocab], the tokens a structured-output grammar permits now (None: all).
        Raises GenerationError when no token can be drawn (NaN logits, a grammar that allows none).
        """
        p = self.params
        logits = raw = logits[: self.vocab_size]
        if self.takes_argmax and allowed is None:
            return self._argmax(logits, raw, allowed)
        logits = logits.clone()  # the steps below edit it in place
        if self.counting and p.repetition_penalty != 1.0:
            seen = self.counts > 0
            penalized = logits[seen]
            logits[seen] = torch.where(penalized > 0, penalized / p.repetition_penalty, penalized * p.repetition_penalty)
        if self.counting and (p.presence_penalty or p.frequency_penalty):
            logits -= p.presence_penalty * (self.output_counts > 0) + p.frequency_penalty * self.output_counts
        if self.bias is not None:
            logits += self.bias
        if allowed is not None:
            logits[~allowed[: self.vocab_size]] = -math.inf
        if p.greedy:
            return self._argmax(logits, raw, allowed)
        logits /= max(p.temperature, MIN_TEMPERATURE)
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
        total = float(cdf[-1])  # NaN if any logit was NaN or +inf, 0 if every token went
        if not (math.isfinite(total) and total > 0):
            raise self._no_token(raw, allowed)
        u = torch.rand(1, generator=self.generator) * total
        return int(torch.searchsorted(cdf, u, right=True))  # the first token whose cdf exceeds u

    def _argmax(self, logits: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor | None) -> int:
        """The first index of the maximum. numpy's takes 4 us over a 49k vocabulary, torch.argmax 45 us
        (64 of them per decode step of a full batch). numpy's stops at a NaN, so one look at the
        chosen logit finds any NaN or +inf in the row, or a row that is -inf throughout."""
        values = logits.numpy()
        token = int(values.argmax())
        if not math.isfinite(values[token]):
            raise self._no_token(raw, allowed)
        return token

    def _no_token(self, raw: torch.Tensor, allowed: torch.Tensor | None) -> GenerationError:
        """Why nothing could be drawn: the model's own logits, the grammar, or (a bug) the parameters."""
        nan, inf = int(raw.isnan().sum()), int(raw.isinf().sum())
        if nan or inf:
            # which layer went non-finite is not known here: finding it would mean checking every layer's output
            return GenerationError(
                f"the model produced {'NaN' if nan else 'infinite'} logits for this request's next token ({nan} NaN,"
                f" {inf} infinite of {raw.shape[0]}): corrupt weights, or activations that overflowed"
            )
        if allowed is not None and not bool(allowed[: self.vocab_size].any()):
            return GenerationError("the structured-output grammar allows no next token")
        p = self.params
        return GenerationError(
            f"no token could be drawn: the sampling parameters left no finite probability (temperature={p.temperature},"
            f" top_k={p.top_k}, top_p={p.top_p}, min_p={p.min_p}, repetition_penalty={p.repetition_penalty})"
        )


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
    keep = probs.cumsum(0) - probs < top_p
    keep[0] = True  # a top_p that float32 rounds to 0 would keep nothing
    outside = torch.ones(n, dtype=torch.bool)
    outside[ids[keep]] = False
    return outside
