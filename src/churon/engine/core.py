"""LLMEngine: many requests at once over a paged KV cache (continuous batching).

One step is the pipeline, in order:

    schedule  the scheduler picks the sequences and how many tokens each runs
    execute   the runner builds the batch and runs the model; each request samples its token
    update    the scheduler counts the computed tokens, commits full blocks to the prefix cache,
              appends the sampled tokens and finishes sequences on stop tokens and max_tokens
    output    each request's detokenizer turns its token into text and finds stop strings;
              the step's deltas

Prompt logprobs need the logits of every prompt position: such a request's prefill chunks return
all their rows, and it never takes prefix-cache hits (a cached position has no logits).

A request that fails in its own stages (NaN logits, its grammar, its logprobs, its detokenizer)
fails alone: it finishes with finish_reason "error" and a message on its output, its blocks go
back, and the step goes on for the others (vLLM's "error" finish reason). generate() returns such
outputs beside the others; a stream raises GenerationError.

Speculative decoding (EngineConfig.speculative, engine/speculative/): before scheduling, each decoding
request may propose tokens; they run in the same step after its last token, and verification keeps those
its own draws agree with, so a step may give a request several tokens (one Delta each) and the output is
the one without speculation.

LoRA adapters (engine/lora.py) are loaded by name with add_lora; a request names one in its
SamplingParams.lora and holds it until it leaves the engine (_leave: finished, aborted or failed),
so remove_lora never takes an adapter from under a request that runs with it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Iterator, Sequence

from tqdm import tqdm

from churon.config import EngineConfig
from churon.engine.block_manager import BlockManager
from churon.engine.kv_cache import PagedKVCache
from churon.engine.latency import Latency
from churon.engine.lora import LoadedLora, LoraManager, unknown_lora
from churon.engine.memory import plan_memory
from churon.engine.output import CompletionOutput, Delta, EngineStats
from churon.engine.request import Request
from churon.engine.runner import ModelRunner
from churon.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from churon.engine.sequence import Sequence as Seq
from churon.engine.speculative import Speculator
from churon.engine.speculative.draft import DraftProposer, check_same_vocabulary
from churon.errors import ContextLengthError, GenerationError
from churon.model.transformer import Transformer
from churon.sampling import SamplingParams
from churon.structured import StructuredOutput
from churon.tokenizer import Tokenizer

if TYPE_CHECKING:
    from churon.formats.lora import LoraAdapter

# Logits of prompt tokens one step may return for prompt logprobs (with chunked prefill): the rows
# of a prompt chunk are vocabulary-wide float32.
PROMPT_LOGITS_BYTES = 128 << 20

log = logging.getLogger("churon.engine")


class LLMEngine:
    """Continuous batching over a paged KV cache. Not thread-safe: one caller drives step()."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig | None = None, *,
                 draft_model: Transformer | None = None, draft_tokenizer: Tokenizer | None = None):
        """draft_model, draft_tokenizer: the draft model config.speculative names (method "draft"), loaded by the
        caller like the model; its vocabulary must be the model's (ValueError naming the first token that differs)."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.model_config = model.config
        self.context_length = min(self.model_config.context_length, self.config.max_model_len or 1 << 62)
        kv_dtype = self.config.kv_torch_dtype(model.kv_dtype)
        model.prepare_argmax()  # before the plan: it may add to the weights
        self.memory_plan = plan_memory(
            self.model_config, model.weight_bytes(), self.config, self.context_length, kv_dtype
        )
        layout = self.memory_plan.layout
        self.cache = PagedKVCache(self.model_config, self.memory_plan.num_blocks, self.config.block_size, kv_dtype, layout)
        self.block_manager = BlockManager(self.memory_plan.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching, layout.windows)
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.enable_chunked_prefill,
            max_prompt_logits_rows=max(1, PROMPT_LOGITS_BYTES // (4 * self.model_config.vocab_size)),
            prefill_chunk_tokens=self.config.prefill_chunk_tokens,
        )
        self.runner = ModelRunner(model, self.cache)
        self.structured_output = StructuredOutput(tokenizer, self.model_config.vocab_size)
        self.requests: dict[int, Request] = {}
        self.latency = Latency()  # the recent requests' time to first token and inter-token gaps
        self.lora: LoraManager | None = None  # made by the first add_lora: an engine without adapters pays nothing
        self.speculator = self._speculator(draft_model, draft_tokenizer, kv_dtype)

    def _speculator(self, draft_model: Transformer | None, draft_tokenizer: Tokenizer | None, kv_dtype) -> Speculator | None:
        spec = self.config.speculative
        if spec is None or spec.method != "draft":
            if draft_model is not None:
                raise ValueError("a draft model was given, but the engine's speculative method is not 'draft'")
            return None if spec is None else Speculator(spec)
        if draft_model is None or draft_tokenizer is None:
            raise ValueError(f"speculative method 'draft' needs the draft model {spec.model!r} and its tokenizer, loaded")
        check_same_vocabulary(self.tokenizer, draft_tokenizer, spec.model)
        # the draft holds as many tokens as the model's cache: every running sequence can propose
        draft = DraftProposer(draft_model, self.memory_plan.num_blocks, self.config.block_size,
                              self.config.kv_torch_dtype(draft_model.kv_dtype),
                              min(self.model_config.vocab_size, draft_model.config.vocab_size))
        # a decode step reads every weight once: the draft's share of the bytes is its share of the time
        return Speculator(spec, draft, draft_cost=draft_model.weight_bytes() / self.model.weight_bytes())

    def add_lora(self, name: str, source: str | os.PathLike | LoraAdapter) -> None:
        """Load a LoRA adapter (a PEFT directory, a GGUF adapter file, or one read already) for requests to
        name in SamplingParams.lora. Raises for a name loaded already, every slot taken (max_loras), or an
        adapter that does not fit the model (ModelFileError naming the tensor; rank above max_lora_rank)."""
        self._lora_manager(name).add(name, source)

    def check_lora_name(self, name: str) -> None:
        """Raise what add_lora(name, ...) would before it reads anything: a bad or taken name, no free slot."""
        self._lora_manager(name).free_slot(name)

    def _lora_manager(self, name: str) -> LoraManager:
        if self.config.max_loras == 0:
            raise ValueError(f"cannot load LoRA adapter {name!r}: this engine was made with max_loras=0")
        if self.lora is None:
            self.lora = LoraManager(self.model, self.config.max_loras, self.config.max_lora_rank)
        return self.lora

    def remove_lora(self, name: str) -> None:
        """New requests can no longer name it (UnknownLoraError); requests already using it finish with it,
        and its slot is freed when the last of them ends."""
        if self.lora is None:
            raise unknown_lora(name, ())
        self.lora.remove(name)

    def lora_names(self) -> tuple[str, ...]:
        """The adapters requests can name, in load order."""
        return self.lora.names if self.lora is not None else ()

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raise ValueError (ContextLengthError when too long) for a prompt this engine can never run."""
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        if len(prompt_ids) >= self.context_length:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens but the context window is {self.context_length} tokens;"
                " shorten the prompt (nothing was truncated)"
            )

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                    arrival: float | None = None) -> int:
        """Queue a request; returns its id. Raises at once for a prompt that can never run, or a LoRA
        adapter that is not loaded (UnknownLoraError, a ValueError). arrival: when the request reached the
        caller (time.perf_counter()), the start of its time to first token; default now."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_prompt(prompt_ids)
        lora = self._lora(params.lora)
        grammar = None
        if params.json_schema is not None or params.grammar is not None:
            grammar = self.structured_output.grammar(params.json_schema, lark=params.grammar)
        max_new = min(params.max_tokens, self.context_length - len(prompt_ids))
        seq = Seq(
            prompt_ids, params, eos_token_ids=self.tokenizer.eog_ids, max_tokens=max_new,
            lora_slot=-1 if lora is None else lora.slot, lora_scale=float(params.lora_scale),
            hash_seed=None if lora is None else lora.hash_seed(params.lora_scale),
        )
        request = Request(seq, self.tokenizer, self.model_config.vocab_size, grammar, self.latency, arrival)
        total = len(prompt_ids) + max_new
        if not self.scheduler.can_ever_fit(total, len(prompt_ids)):
            capacity = min(self.memory_plan.longest_sequence, self.context_length)
            raise ContextLengthError(
                f"the request needs up to {total} tokens of KV cache ({len(prompt_ids)} prompt + {max_new} new)"
                f" but the whole cache holds {capacity} tokens; lower max_tokens or give the engine more kv_cache_memory"
            )
        if lora is not None:
            self.lora.hold(lora)
        self.requests[seq.seq_id] = request
        self.scheduler.add(seq)
        return seq.seq_id

    def _lora(self, name: str | None) -> LoadedLora | None:
        if name is None:
            return None
        if self.lora is None:
            raise unknown_lora(name, ())
        return self.lora.get(name)

    def _leave(self, request_id: int) -> Request:
        """The one way out of the engine for a request (finished, aborted, failed): what it held goes back.
        Its sequence is finished already, so its adapter's slot may be unloaded now."""
        request = self.requests.pop(request_id)
        if request.seq.lora_slot >= 0:
            self.lora.release(request.seq.lora_slot)
        if self.speculator is not None:
            self.speculator.drop(request_id)
        return request

    def abort(self, request_id: int) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already finished."""
        if request_id not in self.requests:
            return False
        self.scheduler.abort(request_id)
        self._leave(request_id).output.finish_reason = "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            running=sched.num_running,
            waiting=sched.num_waiting,
            kv_cache_usage=bm.usage,
            prefix_cache_hit_rate=bm.hit_rate,
            prefix_cache_hit_blocks=bm.num_hit_blocks,
            prefix_cache_miss_blocks=bm.num_miss_blocks,
            preemptions=sched.num_preemptions,
            latency=self.latency.summary(),
            **({} if (spec := self.speculator) is None else {
                "spec_proposed_tokens": spec.num_proposed, "spec_accepted_tokens": spec.num_accepted,
                "spec_verifications": spec.num_verifications,
            }),
        )

    def step(self) -> list[Delta]:
        """One step of the pipeline; the deltas of every request that produced a token."""
        out = self.scheduler.schedule(self._proposals() if self.speculator is not None else None)
        if out.is_empty:
            return []
        sampled, failed = self._execute(out)
        self.scheduler.update_from_output(out, sampled)
        return self._output(sampled, failed)

    def _proposals(self) -> dict[int, list[int]]:
        """Speculative decoding: seq_id -> the tokens each decoding sequence proposes after its last one, at most
        one fewer than max_tokens leaves (verification draws one more), cut where its grammar would refuse them."""
        decoding = [(seq, seq.max_tokens - seq.num_output_tokens - 1) for seq in self.scheduler.running
                    if seq.num_uncomputed_tokens == 1]
        proposals = self.speculator.propose(decoding)
        for seq_id, draft in proposals.items():
            grammar = self.requests[seq_id].grammar
            if grammar is not None:
                del draft[grammar.num_valid(draft):]
        return proposals

    def _execute(self, out: SchedulerOutput) -> tuple[dict[int, list[int]], dict[int, Exception]]:
        """Run the model on the scheduled tokens; seq_id -> the tokens each sampling request drew (one, or
        with proposed tokens the ones verification kept and the draw after them), and seq_id -> the error
        of each request whose logits or sampling failed."""
        all_rows = [self._needs_all_logits(s) for s in out.scheduled]
        argmax_only = not any(all_rows) and all(self.requests[s.seq.seq_id].draws_argmax for s in out.scheduled if s.sample)
        logits = self.runner.execute(out.scheduled, all_rows, argmax_only)
        sampled, failed = {}, {}
        row = 0
        for s, all_logits in zip(out.scheduled, all_rows):
            num_rows = s.num_tokens if all_logits else (1 + len(s.draft)) * int(s.sample)
            rows = logits[row : row + num_rows]
            row += num_rows
            request = self.requests[s.seq.seq_id]
            try:
                if all_logits:
                    request.on_prompt_logits(rows, s.start)
                if s.draft:
                    tokens = sampled[s.seq.seq_id] = request.verify(rows, s.draft)
                    accepted = sum(1 for token, proposed in zip(tokens, s.draft) if token == proposed)
                    self.speculator.record(s.seq.seq_id, len(s.draft), accepted)
                elif s.sample:
                    sampled[s.seq.seq_id] = [request.sample(rows[-1])]
            except Exception as e:  # this request's own logits, grammar or logprobs: it fails alone
                failed[s.seq.seq_id] = e
        return sampled, failed

    def _output(self, sampled: dict[int, list[int]], failed: dict[int, Exception]) -> list[Delta]:
        deltas = [self._fail(self.requests[seq_id], e) for seq_id, e in failed.items()]
        for seq_id, tokens in sampled.items():
            request = self.requests[seq_id]
            for token in tokens:
                try:
                    delta = request.on_token(token)
                except Exception as e:  # its detokenizer or stop strings
                    deltas.append(self._fail(request, e))
                    break
                deltas.append(delta)
                if delta.finish_reason is not None:  # tokens after it (past a stop string) are not output
                    if not request.seq.is_finished:  # a stop string, or a complete structured-output value
                        self.scheduler.finish(request.seq, "stop")
                    self._leave(seq_id)
                    break
        return deltas

    def _fail(self, request: Request, error: Exception) -> Delta:
        """Finish a request that failed in one of its own stages, and only it: its last delta says why."""
        seq = request.seq
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        self._leave(seq.seq_id)
        if isinstance(error, GenerationError):
            message = str(error)
            log.warning("request %d failed: %s", seq.seq_id, message)
        else:  # a bug in one of churon's stages: the traceback goes to the log
            message = f"internal error: {type(error).__name__}: {error}"
            log.error("request %d failed", seq.seq_id, exc_info=error)
        return request.on_error(message)

    def _needs_all_logits(self, s: ScheduledSeq) -> bool:
        return self.requests[s.seq.seq_id].needs_prompt_logits and s.start < s.seq.num_prompt_tokens - 1

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Iterator[Delta]:
        """One request's deltas as they come (requests already queued progress alongside).
        Raises GenerationError if the request fails."""
        request_id = self.add_request(prompt_ids, params)
        try:
            while True:
                for delta in self.step():
                    if delta.request_id == request_id:
                        if delta.finish_reason == "error":
                            raise GenerationError(delta.output.error)
                        yield delta
                        if delta.finish_reason is not None:
                            return
        finally:
            self.abort(request_id)  # the caller stopped early (Ctrl-C, break): free its blocks

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], use_tqdm: bool = False
    ) -> list[CompletionOutput]:
        """Run every prompt to completion in continuous batches; outputs in prompt order.

        A request that failed is there too, with finish_reason "error" and its error (as vLLM's LLM
        returns it): raising would throw away the other prompts' outputs."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(all_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(all_params)} sampling parameters")
        ids: list[int] = []
        outputs: dict[int, CompletionOutput] = {}
        try:
            for p, sp in zip(prompts, all_params):
                ids.append(self.add_request(p, sp))
            wanted = set(ids)
            with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
                while len(outputs) < len(ids):
                    for delta in self.step():  # other callers' requests may be in the batch too
                        if delta.finish_reason is not None and delta.request_id in wanted:
                            outputs[delta.request_id] = delta.output
                            bar.update(1)
        finally:  # a bad prompt, a failed step, Ctrl-C: none of these requests stays behind in the engine
            for i in ids:
                if i not in outputs:
                    self.abort(i)
        return [outputs[i] for i in ids]
