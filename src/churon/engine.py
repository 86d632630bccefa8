"""LLMEngine: many requests at once over a paged KV cache (continuous batching).

add_request -> scheduler picks work -> runner builds the batch and runs the model -> each
request's sampler picks its token -> detokenizer and stop checks -> text deltas

A request's tokens depend only on its own prompt, parameters and seed: its sampler and RNG
are its own, and the kernels compute each token's row the same way whatever else is in the
batch.

Log-probabilities (params.logprobs, params.prompt_logprobs) are those of the model's own
distribution, log_softmax of the raw logits, as vLLM reports by default. Prompt logprobs
need the logits of every prompt position: such a request's prefill chunks return all their
rows, and it never takes prefix-cache hits (a cached position has no logits).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from tqdm import tqdm

from churon.block_manager import BlockManager
from churon.config import EngineConfig
from churon.errors import ContextLengthError
from churon.kv_cache import PagedKVCache
from churon.memory import plan_memory
from churon.model.transformer import Transformer
from churon.runner import ModelRunner
from churon.sampling import Sampler, SamplingParams
from churon.scheduler import ScheduledSeq, Scheduler
from churon.sequence import Sequence as Seq
from churon.structured import Grammar, StructuredOutput
from churon.tokenizer import IncrementalDetokenizer, Tokenizer


# Logits of prompt tokens one step may return for prompt logprobs (with chunked prefill): the rows
# of a prompt chunk are vocabulary-wide float32.
PROMPT_LOGITS_BYTES = 128 << 20

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
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"; None while running
    prompt_token_ids: list[int]
    metrics: Metrics = field(default_factory=Metrics)
    request_id: int = -1
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when params.logprobs is set
    # one per prompt token (the first has none: None), when params.prompt_logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Delta:
    """What one step adds to a request: new text (possibly empty while a UTF-8 sequence or a possible stop string is pending)."""

    request_id: int
    text: str
    token_id: int | None
    finish_reason: str | None  # set on the request's last delta
    output: CompletionOutput  # the request so far (shared and updated by later steps: read finish_reason above)
    logprob: TokenLogprob | None = None  # token_id's, when params.logprobs is set and the token is part of the output


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


class Request:
    """One request's sampling, detokenization and stop state around its Sequence."""

    def __init__(
        self, seq: Seq, tokenizer: Tokenizer, vocab_size: int, context_length: int, grammar: Grammar | None = None
    ):
        params = seq.params
        self.seq = seq
        self.vocab_size = vocab_size
        self.sampler = Sampler(params, vocab_size, seq.prompt_token_ids)
        self.grammar = grammar
        self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        self.stopper = StopChecker(params.stop)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eog_ids))
        self.max_new = min(params.max_tokens, context_length - len(seq.prompt_token_ids))
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.output = CompletionOutput(
            "", [], None, seq.prompt_token_ids, Metrics(prompt_tokens=len(seq.prompt_token_ids)), seq.seq_id
        )
        if params.logprobs is not None:
            self.output.logprobs = []
        if params.prompt_logprobs is not None:
            self.output.prompt_logprobs = [None]  # filled in position order as prefill chunks run

    @property
    def needs_prompt_logits(self) -> bool:
        """Some prompt token's logprob is still unknown: its prefill chunks must return every row."""
        known = self.output.prompt_logprobs
        return known is not None and len(known) < len(self.seq.prompt_token_ids)

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

    def on_logits(self, logits: torch.Tensor) -> Delta:
        """Sample from the raw logits row of the last token (within the grammar, if any) and take the token."""
        allowed = self.grammar.allowed_tokens() if self.grammar is not None else None
        token = self.sampler(logits, allowed)
        num_top = self.seq.params.logprobs
        logprob = None if num_top is None else token_logprobs(logits[None, : self.vocab_size], [token], num_top)[0]
        return self.on_token(token, logprob)

    def on_token(self, token: int, logprob: TokenLogprob | None = None) -> Delta:
        """Take the sampled token: stop checks, text; sets output.finish_reason when the request is done."""
        out = self.output
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
            out.metrics.prefill_seconds = now - self.arrival
            out.metrics.cached_prompt_tokens = self.seq.num_cached_tokens
        if token in self.stop_ids:  # ends the request; not part of the output, nor is its logprob
            out.finish_reason = "stop"
            piece = self.detok.flush()
            logprob = None
        else:
            self.sampler.accept(token)
            out.token_ids.append(token)
            if out.logprobs is not None:
                out.logprobs.append(logprob)
            self.seq.append_token(token)
            piece = self.detok.add(token)
            if self.grammar is not None:
                self.grammar.accept(token)
                if self.grammar.is_terminated:  # the JSON value is complete
                    out.finish_reason = "stop"
        text, hit_stop = self.stopper.add(piece)
        if hit_stop:
            out.finish_reason = "stop"
        elif out.finish_reason is None and len(out.token_ids) >= self.max_new:
            out.finish_reason = "length"
        if out.finish_reason is not None and not hit_stop:
            tail, hit_stop = self.stopper.add(self.detok.flush())
            text += tail if hit_stop else tail + self.stopper.flush()
            out.finish_reason = "stop" if hit_stop else out.finish_reason
        out.text += text
        out.metrics.generated_tokens = len(out.token_ids)
        out.metrics.decode_seconds = now - self.first_token_time
        return Delta(out.request_id, text, token, out.finish_reason, out, logprob)


class LLMEngine:
    """Continuous batching over a paged KV cache. Not thread-safe: one caller drives step()."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.model_config = model.config
        self.context_length = min(self.model_config.context_length, self.config.max_model_len or 1 << 62)
        kv_dtype = self.config.kv_torch_dtype(model.kv_dtype)
        self.memory_plan = plan_memory(
            self.model_config, model.weight_bytes(), self.config, self.context_length, kv_dtype
        )
        self.cache = PagedKVCache(self.model_config, self.memory_plan.num_blocks, self.config.block_size, kv_dtype)
        self.block_manager = BlockManager(self.memory_plan.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.enable_chunked_prefill,
            max_prompt_logits_rows=max(1, PROMPT_LOGITS_BYTES // (4 * self.model_config.vocab_size)),
        )
        self.runner = ModelRunner(model, self.cache)
        self.structured_output = StructuredOutput(tokenizer, self.model_config.vocab_size)
        self.requests: dict[int, Request] = {}

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Raises at once for a prompt that can never run."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        check_prompt(prompt_ids, self.model_config.vocab_size, self.context_length)
        grammar = None if params.json_schema is None else self.structured_output.grammar(params.json_schema)
        seq = Seq(prompt_ids, params)
        request = Request(seq, self.tokenizer, self.model_config.vocab_size, self.context_length, grammar)
        total = len(prompt_ids) + request.max_new
        if not self.scheduler.can_ever_fit(total, len(prompt_ids)):
            capacity = self.memory_plan.num_blocks * self.config.block_size
            raise ContextLengthError(
                f"the request needs up to {total} tokens of KV cache ({len(prompt_ids)} prompt + {request.max_new} new)"
                f" but the whole cache holds {capacity} tokens; lower max_tokens or give the engine more kv_cache_memory"
            )
        self.requests[seq.seq_id] = request
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        request.output.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Delta]:
        """Schedule, run the model once, sample; the deltas of every request that produced a token."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        all_rows = [self._needs_all_logits(s) for s in out.scheduled]
        logits = self.runner.execute(out.scheduled, all_rows)
        deltas = []
        row = 0
        for s, all_logits in zip(out.scheduled, all_rows):
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            self.block_manager.commit(seq)
            num_rows = s.num_tokens if all_logits else int(s.sample)
            rows = logits[row : row + num_rows]
            row += num_rows
            request = self.requests[seq.seq_id]
            if all_logits:
                request.on_prompt_logits(rows, s.start)
            if not s.sample:
                continue
            delta = request.on_logits(rows[-1])
            if delta.finish_reason is not None:
                self.scheduler.finish(seq, delta.finish_reason)
                del self.requests[seq.seq_id]
            deltas.append(delta)
        return deltas

    def _needs_all_logits(self, s: ScheduledSeq) -> bool:
        return self.requests[s.seq.seq_id].needs_prompt_logits and s.start < s.seq.num_prompt_tokens - 1

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Iterator[Delta]:
        """One request's deltas as they come (requests already queued progress alongside)."""
        request_id = self.add_request(prompt_ids, params)
        try:
            while True:
                for delta in self.step():
                    if delta.request_id == request_id:
                        yield delta
                        if delta.finish_reason is not None:
                            return
        finally:
            self.abort(request_id)  # the caller stopped early (Ctrl-C, break): free its blocks

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], use_tqdm: bool = False
    ) -> list[CompletionOutput]:
        """Run every prompt to completion in continuous batches; outputs in prompt order."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(all_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(all_params)} sampling parameters")
        ids: list[int] = []
        try:
            for p, sp in zip(prompts, all_params):
                ids.append(self.add_request(p, sp))
        except Exception:  # a bad prompt: the ones queued before it do not stay behind
            for i in ids:
                self.abort(i)
            raise
        outputs: dict[int, CompletionOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(outputs) < len(ids):
                for delta in self.step():
                    if delta.finish_reason is not None:
                        outputs[delta.request_id] = delta.output
                        bar.update(1)
        return [outputs[i] for i in ids]
