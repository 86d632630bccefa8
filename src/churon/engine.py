"""LLMEngine: many requests at once over a paged KV cache (continuous batching).

add_request -> scheduler picks work -> runner builds the batch and runs the model -> each
request's sampler picks its token -> detokenizer and stop checks -> text deltas

A request's tokens depend only on its own prompt, parameters and seed: its sampler and RNG
are its own, and the kernels compute each token's row the same way whatever else is in the
batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from tqdm import tqdm

from churon.block_manager import BlockManager
from churon.config import EngineConfig
from churon.errors import ContextLengthError
from churon.kv_cache import PagedKVCache
from churon.memory import plan_memory
from churon.model.transformer import Transformer
from churon.runner import ModelRunner
from churon.sampling import Sampler, SamplingParams
from churon.scheduler import Scheduler
from churon.sequence import Sequence as Seq
from churon.tokenizer import IncrementalDetokenizer, Tokenizer


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
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "abort"; None while running
    prompt_token_ids: list[int]
    metrics: Metrics = field(default_factory=Metrics)
    request_id: int = -1


@dataclass
class Delta:
    """What one step adds to a request: new text (possibly empty while a UTF-8 sequence or a possible stop string is pending)."""

    request_id: int
    text: str
    token_id: int | None
    finish_reason: str | None  # set on the request's last delta
    output: CompletionOutput  # the request so far (shared and updated by later steps: read finish_reason above)


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

    def __init__(self, seq: Seq, tokenizer: Tokenizer, vocab_size: int, context_length: int):
        params = seq.params
        self.seq = seq
        self.sampler = Sampler(params, vocab_size, seq.prompt_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        self.stopper = StopChecker(params.stop)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eog_ids))
        self.max_new = min(params.max_tokens, context_length - len(seq.prompt_token_ids))
        self.arrival = time.perf_counter()
        self.first_token_time: float | None = None
        self.output = CompletionOutput(
            "", [], None, seq.prompt_token_ids, Metrics(prompt_tokens=len(seq.prompt_token_ids)), seq.seq_id
        )

    def on_token(self, token: int) -> Delta:
        """Take the sampled token: stop checks, text; sets output.finish_reason when the request is done."""
        out = self.output
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
            out.metrics.prefill_seconds = now - self.arrival
            out.metrics.cached_prompt_tokens = self.seq.num_cached_tokens
        if token in self.stop_ids:
            out.finish_reason = "stop"
            piece = self.detok.flush()
        else:
            self.sampler.accept(token)
            out.token_ids.append(token)
            self.seq.append_token(token)
            piece = self.detok.add(token)
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
        return Delta(out.request_id, text, token, out.finish_reason, out)


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
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.enable_chunked_prefill
        )
        self.runner = ModelRunner(model, self.cache)
        self.requests: dict[int, Request] = {}

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Raises at once for a prompt that can never run."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        check_prompt(prompt_ids, self.model_config.vocab_size, self.context_length)
        seq = Seq(prompt_ids, params)
        request = Request(seq, self.tokenizer, self.model_config.vocab_size, self.context_length)
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
        logits = self.runner.execute(out.scheduled)
        deltas = []
        row = 0
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_tokens
            self.block_manager.commit(seq)
            if not s.sample:
                continue
            request = self.requests[seq.seq_id]
            delta = request.on_token(request.sampler(logits[row]))
            row += 1
            if delta.finish_reason is not None:
                self.scheduler.finish(seq, delta.finish_reason)
                del self.requests[seq.seq_id]
            deltas.append(delta)
        return deltas

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
