"""Sequence: one request's tokens and its place in the engine (waiting, running, finished).

A sequence is the unit the scheduler and the block manager work on. Its token_ids are the
prompt followed by the tokens generated so far; num_computed_tokens of them have their keys
and values in the KV cache (the blocks listed in its block tables). The tokens still to run
through the model are token_ids[num_computed_tokens:]:

    prefill   many uncomputed tokens (the prompt, in one step or in chunks)
    decode    one uncomputed token (the one sampled last step)

After a preemption the sequence gives its blocks back and starts over: num_computed_tokens
is 0 again and the next prefill recomputes prompt and generated tokens together.

A sequence also carries when it ends on a token: a stop token (its params' stop_token_ids, and
the model's end-of-generation ids unless params.ignore_eos) ends it without becoming part of it;
max_tokens generated tokens end it too. Stop strings need the text: the engine's output stage
checks them.

A sequence run under a LoRA adapter carries the adapter's slot and scale (the runner gives them to each
of its tokens) and the seed its block-hash chain starts from (engine/lora.py), so the prefix cache never
shares its blocks with a sequence under another adapter or scale, or under none. The scale is the
params' value when the sequence was made: the seed was computed from it, and params are the caller's,
free to change.
"""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto
from typing import Iterable, Literal

from churon.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]  # "error": that request alone failed (GenerationError)

_next_seq_id = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()  # queued, holds no KV blocks (new, or preempted and waiting to recompute)
    RUNNING = auto()  # holds KV blocks; scheduled step after step
    FINISHED = auto()  # done (stop, length, abort or error); blocks given back


class Sequence:
    """One request's tokens and cache bookkeeping.

    seq_id: unique; increasing ids mean later arrival (the scheduler's preemption order).
        Taken from a process-wide counter unless the caller gives one.
    block_tables: per KV group (model/kv_layout.py; one for a model without windowed layers) its KV block
        ids; block i holds tokens [i * block_size, (i + 1) * block_size). [] while it holds no blocks. A windowed
        group's leading entries, released, are never read (engine/block_manager.py).
    num_computed_tokens: leading tokens whose K/V are in the cache; the block manager counts
        them (allocation, commit after each step, free).
    num_cached_tokens: how many leading tokens the last allocation took from the prefix
        cache (metrics; the block manager sets it).
    block_hashes: chained hashes of the sequence's full blocks, a memo the block manager
        extends lazily (a pure function of hash_seed and token_ids, so preemption leaves it valid).
    lora_slot: the slot of its LoRA adapter in the model (-1: none).
    lora_scale: what the adapter's delta is multiplied by (the hash seed's scale).
    hash_seed: the parent hash of its first block (None: no adapter).
    """

    def __init__(
        self,
        prompt_token_ids: Iterable[int],
        params: SamplingParams | None = None,
        *,
        seq_id: int | None = None,
        arrival_time: float | None = None,
        eos_token_ids: Iterable[int] = (),
        max_tokens: int | None = None,
        lora_slot: int = -1,
        lora_scale: float = 1.0,
        hash_seed: int | None = None,
    ):
        """eos_token_ids: the model's end-of-generation ids. max_tokens: the most tokens to generate
        (default params.max_tokens; the engine lowers it to what the context leaves)."""
        self.prompt_token_ids: list[int] = [int(t) for t in prompt_token_ids]
        if not self.prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id: int = next(_next_seq_id) if seq_id is None else int(seq_id)
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens: int = len(self.prompt_token_ids)
        self.params: SamplingParams = params if params is not None else SamplingParams()
        eos = frozenset() if self.params.ignore_eos else frozenset(int(t) for t in eos_token_ids)
        self.stop_token_ids: frozenset[int] = frozenset(self.params.stop_token_ids) | eos
        self.max_tokens: int = self.params.max_tokens if max_tokens is None else max_tokens
        self.arrival_time: float = time.monotonic() if arrival_time is None else arrival_time
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens: int = 0
        self.num_cached_tokens: int = 0
        self.block_tables: list[list[int]] = []
        self.block_hashes: list[int] = []
        self.lora_slot: int = lora_slot
        self.lora_scale: float = lora_scale
        self.hash_seed: int | None = hash_seed

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}"
            f" (prompt {self.num_prompt_tokens}), computed={self.num_computed_tokens}, blocks={self.block_tables})"
        )

    @property
    def block_table(self) -> list[int]:
        """The first KV group's block table (a model without windowed layers has no other); [] without blocks."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model: the prompt (rest) in prefill, 1 in decode,
        everything after a preemption."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a generated token (its K/V get computed in the next step)."""
        self.token_ids.append(int(token_id))
