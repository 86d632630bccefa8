"""Running one request: prefill, then decode token by token, with stop handling and streaming text.

request -> prefill (prompt through the model, KV cache filled) -> sampler -> decode steps
        -> detokenizer -> stop checks -> text deltas
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from churon.errors import ContextLengthError
from churon.model.transformer import Transformer
from churon.sampling import Sampler, SamplingParams
from churon.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Metrics:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0  # also the time to first token
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first token comes out of prefill; the rest each cost one decode step
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length"; None while running
    prompt_token_ids: list[int]
    metrics: Metrics = field(default_factory=Metrics)


@dataclass
class Delta:
    """What one step adds: new text (possibly empty while a UTF-8 sequence or a possible stop string is pending)."""

    text: str
    token_id: int | None
    output: CompletionOutput  # the request so far; finish_reason set on the last delta


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, context_length: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    if len(prompt_ids) >= context_length:
        raise ContextLengthError(
            f"the prompt has {len(prompt_ids)} tokens but the context window is {context_length} tokens;"
            " shorten the prompt (nothing was truncated)"
        )


class StopChecker:
    """Finds stop strings in the generated text and holds back text that could be the start of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.text = ""  # everything decoded so far
        self.emitted = 0  # how much of it was released

    def add(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was hit)."""
        self.text += piece
        if not self.stops:
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out, False
        longest = max(len(s) for s in self.stops)
        search_from = max(0, self.emitted - longest + 1)
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            end = min(hits)
            out = self.text[self.emitted : end]
            self.text = self.text[:end]
            self.emitted = end
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.emitted), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = len(self.text) - hold
        out = self.text[self.emitted : end]
        self.emitted = end
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


class LLMEngine:
    """Generates for one request at a time over a contiguous KV cache."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[Delta]:
        prompt_ids = [int(t) for t in prompt_ids]
        check_prompt(prompt_ids, self.config.vocab_size, self.config.context_length)
        sampler = Sampler(params, self.config.vocab_size, prompt_ids)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens)
        stopper = StopChecker(params.stop)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.eog_ids)
        max_new = min(params.max_tokens, self.config.context_length - len(prompt_ids))
        cache = self.model.new_cache(len(prompt_ids) + max_new)
        out = CompletionOutput("", [], None, prompt_ids, Metrics(prompt_tokens=len(prompt_ids)))

        t0 = time.perf_counter()
        logits = self.model(torch.tensor(prompt_ids, dtype=torch.long), 0, cache)
        position = len(prompt_ids)
        t_first = None
        while True:
            token = sampler(logits[-1])
            if t_first is None:
                t_first = time.perf_counter()
                out.metrics.prefill_seconds = t_first - t0
            if token in stop_ids:
                out.finish_reason = "stop"
                piece = detok.flush()
            else:
                sampler.accept(token)
                out.token_ids.append(token)
                piece = detok.add(token)
            text, hit_stop = stopper.add(piece)
            if hit_stop:
                out.finish_reason = "stop"
            elif out.finish_reason is None and len(out.token_ids) >= max_new:
                out.finish_reason = "length"
            if out.finish_reason is not None and not hit_stop:
                tail, hit_stop = stopper.add(detok.flush())
                text += tail if hit_stop else tail + stopper.flush()
                out.finish_reason = "stop" if hit_stop else out.finish_reason
            out.text += text
            out.metrics.generated_tokens = len(out.token_ids)
            if out.finish_reason is not None:
                out.metrics.decode_seconds = time.perf_counter() - t_first
                yield Delta(text, token, out)
                return
            yield Delta(text, token, out)
            logits = self.model(torch.tensor([token], dtype=torch.long), position, cache)
            position += 1

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> CompletionOutput:
        for delta in self.stream(prompt_ids, params):
            pass
        return delta.output
