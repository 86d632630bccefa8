"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step (as vLLM v1 does it):

1. RUNNING sequences, oldest first, get their next tokens within the token budget: one
   for a decode, the next chunk for a prefill still in progress. When the block manager
   cannot give one the block it needs, the most recently arrived running sequence is
   preempted (blocks freed, back to the front of the waiting queue, recomputed later from
   prompt + generated tokens) and the allocation retried.
2. If nothing was preempted, WAITING sequences are admitted first come, first served while
   the budget, max_num_seqs and free blocks allow. With chunked prefill a prompt longer
   than the budget left is split; without it a prompt runs whole or waits. The queue head
   blocks the queue: nobody overtakes it.

With chunked prefill, the prompt tokens of a step (running prefills and admitted prompts together) are also held to
prefill_chunk_tokens whenever more than one sequence is in the engine: a burst of requests then gets its first
tokens in arrival order, a few requests a step, instead of all of them at the end of one long step; the requests
that decode meanwhile wait one chunk at most between tokens; and since the burst's requests start (and, of one
length, finish) at different steps, the next burst is spread out too (a 16-stream load whose requests all began and
ended in the same step waited ~0.7 s for each first token, spread out ~0.1 s). A prompt alone in the engine runs at
the whole budget. A head whose prompt shares full blocks with a prompt
   still being computed by a running sequence waits for them to be cached (a burst of requests
   with one system prompt computes it once, not once per request admitted in the same step).

A sequence that asks for prompt logprobs returns a row of logits for every prompt token it runs
(vocabulary-wide: 2048 rows of a 152k vocabulary are 1.2 GB); with chunked prefill, all such
sequences together run at most max_prompt_logits_rows prompt tokens per step.

After the runner executed a step, update_from_output takes what it computed: every scheduled
sequence's tokens count as computed (their full blocks enter the prefix cache), each sampled
token is appended, and a sequence ending on a stop token or at max_tokens is finished.

Speculative decoding (engine/speculative/): schedule() may be given proposed tokens for decoding
sequences. They run after the sequence's last token within the same token budget, and get blocks, but
never cost anyone else anything: where the budget is short they are cut, and where their blocks cannot
be had they are dropped before any sequence is preempted. After the step a sequence's accepted
proposals count as computed, and the blocks only its rejected ones used go back.

Finishing a sequence costs O(1) wherever it is: one leaving the waiting queue (an abort: a client
that disconnected) stays in it, finished, until it reaches the head or the queue is compacted (once
finished ones are half of it), so 40k queued aborts cost 40k steps of work, not 40k scans of the queue.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from churon.engine.block_manager import BlockManager
from churon.engine.sequence import FinishReason, Sequence, SequenceStatus
from churon.errors import ChuronError


class CacheCapacityError(ChuronError, RuntimeError):
    """A sequence cannot run even alone: the KV pool (or, without chunked prefill, the token budget) is too small."""


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: tokens token_ids[start : start + num_tokens] run through the model."""

    seq: Sequence
    num_tokens: int
    # proposed tokens (speculative decoding) run after the sequence's last token, whose logits verify them
    draft: list[int] = field(default_factory=list)
    start: int = field(init=False)  # seq.num_computed_tokens when scheduled: position of the first token
    sample: bool = field(init=False)  # this step computes the last uncomputed token: sample from its logits

    def __post_init__(self):
        self.start = self.seq.num_computed_tokens
        self.sample = self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # running ones oldest first, then admitted ones
    preempted: list[Sequence] = field(default_factory=list)  # sent back to WAITING this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens + len(s.draft) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        max_prompt_logits_rows: int | None = None,
        prefill_chunk_tokens: int | None = None,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_prompt_logits_rows = max_prompt_logits_rows  # None: no limit
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens  # None: no limit but the budget
        # FCFS; preempted sequences go back to the front. Holds finished sequences too (see finish)
        self._waiting: deque[Sequence] = deque()
        self._num_finished_waiting = 0  # finished sequences still in _waiting
        self.running: list[Sequence] = []  # sorted by seq_id (arrival order); at most max_num_seqs
        self._unfinished: dict[int, Sequence] = {}
        self.num_preemptions = 0

    # -- queries -----------------------------------------------------------------------

    @property
    def waiting(self) -> list[Sequence]:
        """The waiting sequences in queue order."""
        return [seq for seq in self._waiting if not seq.is_finished]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) - self._num_finished_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def get(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence with this id, or None."""
        return self._unfinished.get(seq_id)

    def can_ever_fit(self, num_tokens: int, num_prompt_tokens: int | None = None) -> bool:
        """Whether a sequence growing to num_tokens tokens (prompt + the most it may generate)
        can run alone: its blocks fit in the whole pool, and without chunked prefill its
        prompt (num_prompt_tokens, default num_tokens) fits the token budget. The engine
        rejects requests for which this is False; schedule() raises CacheCapacityError on them.
        """
        if num_tokens < 1:
            return False
        bm = self.block_manager
        if bm.num_blocks_held(num_tokens, min(num_tokens, self.max_num_batched_tokens)) > bm.num_blocks:
            return False
        prompt = num_tokens if num_prompt_tokens is None else num_prompt_tokens
        return self.enable_chunked_prefill or prompt <= self.max_num_batched_tokens

    # -- request life cycle ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (WAITING, holding no blocks) at the back of the waiting queue."""
        if seq.seq_id in self._unfinished:
            raise ValueError(f"sequence {seq.seq_id} was added twice")
        if seq.status is not SequenceStatus.WAITING or seq.block_tables:
            raise ValueError(f"only a new waiting sequence can be added, got {seq!r}")
        self._unfinished[seq.seq_id] = seq
        self._waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark seq finished, give its blocks back and drop it from the queues."""
        if self._unfinished.pop(seq.seq_id, None) is None:
            raise ValueError(f"sequence {seq.seq_id} is not scheduled here (unknown or already finished)")
        waiting = seq.status is SequenceStatus.WAITING
        if not waiting:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if waiting:  # left in the queue: removing it would scan the queue
            self._num_finished_waiting += 1
            if self._num_finished_waiting > len(self._waiting) // 2:
                self._waiting = deque(s for s in self._waiting if not s.is_finished)
                self._num_finished_waiting = 0

    def abort(self, seq_id: int) -> bool:
        """Finish a waiting or running sequence now with reason "abort". False if unknown or finished."""
        seq = self._unfinished.get(seq_id)
        if seq is None:
            return False
        self.finish(seq, "abort")
        return True

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[int, list[int]]) -> None:
        """After the step `out` ran: its tokens are computed, and sampled (seq_id -> the tokens each sequence
        that sampled drew: one, or with proposals the accepted ones and the draw after them) extends the
        sequences. A stop token finishes its sequence with "stop" without joining it; reaching seq.max_tokens
        finishes it with "length". An accepted proposal's K/V were computed in the step: it counts as computed;
        the blocks that only rejected proposals filled go back."""
        bm = self.block_manager
        for s in out.scheduled:
            seq = s.seq
            bm.commit(seq, s.num_tokens)
            tokens = sampled.get(seq.seq_id, ())
            for i, token in enumerate(tokens):
                if token in seq.stop_token_ids:
                    self.finish(seq, "stop")
                    break
                seq.append_token(token)
                if seq.num_output_tokens >= seq.max_tokens:
                    self.finish(seq, "length")
                    break
                if i < len(tokens) - 1:  # an accepted proposal: its K/V are the ones the step wrote
                    bm.commit(seq, 1)
            if s.draft and not seq.is_finished:
                bm.truncate(seq, seq.num_tokens)

    # -- scheduling --------------------------------------------------------------------

    def schedule(self, proposals: Mapping[int, list[int]] | None = None) -> SchedulerOutput:
        """The next step. proposals: seq_id -> tokens proposed after a decoding sequence's last token."""
        out = SchedulerOutput()
        proposals = proposals or {}
        budget = self.max_num_batched_tokens
        logits_rows = self.max_prompt_logits_rows if self.enable_chunked_prefill else None
        bm = self.block_manager
        # the step's prompt tokens: a chunk while others are in the engine, the whole budget for a prompt alone
        prompts = budget
        if self.enable_chunked_prefill and self.prefill_chunk_tokens and len(self.running) + self.num_waiting > 1:
            prompts = self.prefill_chunk_tokens

        def limit(seq: Sequence, n: int) -> int:  # n within the step's prompt tokens and rows of prompt logits
            if n > 1 or seq.num_uncomputed_tokens > 1:  # a prompt (or a recomputation), not a decode
                n = min(n, prompts)
            return min(n, logits_rows) if logits_rows is not None and _scores_prompt(seq) else n

        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = limit(seq, min(seq.num_uncomputed_tokens, budget))
            if n <= 0:  # its sampled token is not appended yet, or no prompt-logits rows are left this step
                i += 1
                continue
            draft = proposals.get(seq.seq_id, [])[: budget - n] if seq.num_uncomputed_tokens == 1 else []
            if draft and not bm.allocate(seq, n + len(draft)):
                draft = []  # a proposal never preempts anyone: the sequence runs without it
            while not draft and not bm.allocate(seq, n):
                victim = self.running[-1]
                if victim is seq and i == 0:
                    raise CacheCapacityError(
                        f"sequence {seq.seq_id} needs {bm.num_blocks_held(seq.num_computed_tokens + n, n)} KV blocks"
                        f" of {bm.block_size} tokens but the pool has {bm.num_blocks}; it can never run"
                        " (check requests with Scheduler.can_ever_fit)"
                    )
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n, draft))
                budget -= n + len(draft)
                if seq.num_uncomputed_tokens > 1:
                    prompts -= n
                if logits_rows is not None and _scores_prompt(seq):
                    logits_rows -= n
                i += 1

        # 2. waiting sequences, first come first served
        if out.preempted:
            return out
        while budget > 0 and len(self.running) < self.max_num_seqs and (seq := self._waiting_head()) is not None:
            cached = bm.num_cached_prefix_tokens(seq)
            if self._prefix_in_progress(seq, cached):
                break
            remaining = seq.num_tokens - cached
            n = limit(seq, min(remaining, budget))
            if n <= 0:
                break  # no prompt-logits rows left this step; the queue waits behind its head
            if n < remaining and not self.enable_chunked_prefill:
                if remaining <= self.max_num_batched_tokens:
                    break  # runs whole in a later step
                if seq.num_output_tokens == 0:
                    raise CacheCapacityError(
                        f"the prompt of sequence {seq.seq_id} has {seq.num_tokens} tokens, more than"
                        f" max_num_batched_tokens={self.max_num_batched_tokens}, and chunked prefill is off;"
                        " it can never run (check requests with Scheduler.can_ever_fit)"
                    )
                if budget < self.max_num_batched_tokens:
                    break
                # a preempted sequence grown past the budget: its recomputation is the one case
                # chunked even without chunked prefill (the only way it can ever resume)
            if not bm.allocate(seq, n):
                if not self.running and bm.num_used_blocks == 0:
                    raise CacheCapacityError(
                        f"sequence {seq.seq_id} ({seq.num_tokens} tokens) cannot get"
                        f" {bm.num_blocks_held(seq.num_computed_tokens + n, n)} KV blocks from an empty pool of"
                        f" {bm.num_blocks}; it can never run (check requests with Scheduler.can_ever_fit)"
                    )
                break
            self._waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            prompts -= n
            if logits_rows is not None and _scores_prompt(seq):
                logits_rows -= n
        return out

    def _waiting_head(self) -> Sequence | None:
        """The first waiting sequence, after dropping the finished ones ahead of it."""
        while self._waiting and self._waiting[0].is_finished:
            self._waiting.popleft()
            self._num_finished_waiting -= 1
        return self._waiting[0] if self._waiting else None

    def _prefix_in_progress(self, seq: Sequence, cached: int) -> bool:
        """A running sequence has yet to compute prompt blocks that seq shares beyond its `cached` tokens."""
        for other in self.running:
            if other.num_computed_tokens < other.num_prompt_tokens:  # still in its prompt
                shared = self.block_manager.num_shared_prefix_tokens(seq, other)
                if shared > cached and other.num_computed_tokens < shared:
                    return True
        return False

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)  # also sets num_computed_tokens = 0: recompute everything
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1


def _scores_prompt(seq: Sequence) -> bool:
    """seq's next chunk returns a row of logits per token: it asks for prompt logprobs and is in its prompt."""
    return seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens
