"""Request: one request's state around its Sequence, for the two ends of a step.

Execute: sample() draws the next token from the raw logits row of the sequence's last token, within
its grammar if it has one, and records prompt logprobs from prefill rows; verify() draws from the rows of
tokens proposed by speculative decoding in turn, keeping the proposals its draws agree with. Output:
on_token() turns each token the scheduler took (or ended the sequence on) into text through the
detokenizer, which also finds stop strings, and gives its Delta.

A request's tokens depend only on its own prompt, parameters and seed: its sampler and RNG are its
own, and the kernels compute each token's row the same way whatever else is in the batch.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from churon.engine.latency import Latency
from churon.engine.output import CompletionOutput, Delta, Metrics, TokenLogprob, token_logprobs
from churon.engine.sequence import Sequence
from churon.sampling import Sampler
from churon.structured import Grammar
from churon.tokenizer import Detokenizer, Tokenizer


class Request:
    def __init__(self, seq: Sequence, tokenizer: Tokenizer, vocab_size: int, grammar: Grammar | None = None,
                 latency: Latency | None = None, arrival: float | None = None):
        """latency: where the engine records this request's time to first token and inter-token gaps; arrival: when
        the request came in (time.perf_counter(); default now)."""
        params = seq.params
        self.latency = latency
        self.seq = seq
        self.vocab_size = vocab_size
        self.sampler = Sampler(params, vocab_size, seq.prompt_token_ids)
        self.grammar = grammar
        self.detokenizer = Detokenizer(tokenizer, seq.prompt_token_ids, params.skip_special_tokens, params.stop)
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # per token drawn and not yet output: its logprob (when params.logprobs is set) and whether it completed the
        # structured-output value (a verification draws several tokens before the first is output)
        self._drawn: deque[tuple[TokenLogprob | None, bool]] = deque()
        self.output = CompletionOutput(
            "", [], None, seq.prompt_token_ids, Metrics(prompt_tokens=len(seq.prompt_token_ids)), seq.seq_id
        )
        if params.logprobs is not None:
            self.output.logprobs = []
        if params.prompt_logprobs is not None:
            self.output.prompt_logprobs = [None]  # filled in position order as prefill chunks run

    # -- execute -----------------------------------------------------------------------

    @property
    def needs_prompt_logits(self) -> bool:
        """Some prompt token's logprob is still unknown: its prefill chunks must return every row."""
        known = self.output.prompt_logprobs
        return known is not None and len(known) < len(self.seq.prompt_token_ids)

    @property
    def draws_argmax(self) -> bool:
        """Each token is the first maximum of its raw logits row and nothing else of the row is read: greedy, without
        penalties, logit bias, grammar or logprobs."""
        return self.grammar is None and self.seq.params.logprobs is None and self.sampler.takes_argmax

    def on_prompt_logits(self, logits: torch.Tensor, start: int) -> None:
        """logits: the raw rows of positions start, start + 1, ...; position p's row scores prompt token p + 1."""
        known, prompt = self.output.prompt_logprobs, self.seq.prompt_token_ids
        # after a preemption the prompt runs again from 0: positions already scored are skipped
        first, end = len(known), min(start + logits.shape[0] + 1, len(prompt))
        if first <= start:  # cannot happen: such a request takes no prefix-cache hits, so chunks run from 0
            raise RuntimeError(f"request {self.seq.seq_id}: prompt positions {first - 1}..{start - 1} were never scored")
        if first < end:
            rows = logits[first - 1 - start : end - 1 - start, : self.vocab_size]
            known.extend(token_logprobs(rows, prompt[first:end], self.seq.params.prompt_logprobs))

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from the raw logits row of the last token (within the grammar, if any).
        A token that continues the sequence (not a stop token) is taken by the penalties' counts and the grammar."""
        allowed = self.grammar.allowed_tokens() if self.grammar is not None else None
        token = self.sampler(logits, allowed)
        num_top = self.seq.params.logprobs
        logprob = None if num_top is None else token_logprobs(logits[None, : self.vocab_size], [token], num_top)[0]
        if token not in self.seq.stop_token_ids:
            self.sampler.accept(token)
            if self.grammar is not None:
                self.grammar.accept(token)
        self._drawn.append((logprob, self.grammar is not None and self.grammar.is_terminated))
        return token

    def verify(self, logits: torch.Tensor, draft: list[int]) -> list[int]:
        """Speculative decoding's verification. logits: the raw rows of the last token and of each proposed token
        after it (1 + len(draft) rows). Each row is sampled as decoding would sample it, in turn, while the draws
        equal the proposals: the tokens are the accepted proposals and the draw after them (the first that differs,
        or the one after the last proposal). A stop token, max_tokens or a complete structured-output value ends
        them early: nothing after the end is drawn, so the sampler's generator advances exactly as without
        proposals."""
        seq = self.seq
        room = seq.max_tokens - seq.num_output_tokens
        tokens: list[int] = []
        for i, row in enumerate(logits[: len(draft) + 1]):
            token = self.sample(row)
            tokens.append(token)
            done = token in seq.stop_token_ids or len(tokens) >= room or (self.grammar is not None and self.grammar.is_terminated)
            if done or i == len(draft) or token != draft[i]:
                break
        return tokens

    # -- output ------------------------------------------------------------------------

    def on_token(self, token: int) -> Delta:
        """The text the sampled token adds, after the scheduler took it. Sets output.finish_reason when the
        request is done: the scheduler's reason (a stop token, max_tokens), or "stop" for a stop string or
        a complete structured-output value; the engine finishes the sequence for those two."""
        out, seq = self.output, self.seq
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
            out.metrics.prefill_seconds = now - self.arrival
            out.metrics.cached_prompt_tokens = seq.num_cached_tokens
            if self.latency is not None:
                self.latency.ttft.add(out.metrics.prefill_seconds)
        elif self.latency is not None:
            self.latency.itl.add(now - self.last_token_time)
        self.last_token_time = now
        logprob, completes_value = self._drawn.popleft()
        out.token_ids.append(token)
        if out.logprobs is not None:
            out.logprobs.append(logprob)
        if token in seq.stop_token_ids:
            # a generated stop token is part of the output's tokens and logprobs, not of its text (vLLM's
            # and OpenAI's rule): echo + max_tokens=N then always returns prompt + N entries, and a client
            # that drops the last entry as the generated token's (lm-eval) drops this one, not a prompt token's
            out.finish_reason = "stop"
            text = self.detokenizer.finish()
        else:
            text = self.detokenizer.update(token)
            if self.detokenizer.stopped or completes_value:
                out.finish_reason = "stop"
            elif seq.finish_reason == "length" and len(out.token_ids) >= seq.max_tokens:  # at the last token a step drew
                out.finish_reason = "length"
            if out.finish_reason is not None and not self.detokenizer.stopped:
                text += self.detokenizer.finish()
                if self.detokenizer.stopped:
                    out.finish_reason = "stop"
        out.text += text
        out.metrics.generated_tokens = len(out.token_ids)
        out.metrics.decode_seconds = now - self.first_token_time
        return Delta(out.request_id, text, token, out.finish_reason, out, logprob)

    def on_error(self, message: str) -> Delta:
        """The request failed in one of its stages (GenerationError, or a bug): its last Delta, without text."""
        out = self.output
        out.finish_reason, out.error = "error", message
        return Delta(out.request_id, "", None, "error", out)
