"""ForwardBatch: the tensors one model step needs for many sequences at once.

Tokens of all sequences are laid end to end ([tokens] "flat" layout). For each token: its
id, its position in its sequence and the KV-cache slot its keys and values go to. For each
sequence: where its tokens start in the flat layout, how many keys its attention sees, and
its block table. logits_indices says which tokens' logits the step returns. A sequence run under
a LoRA adapter gives each of its tokens the adapter's slot and the request's lora_scale.

A model whose windowed and global layers keep their K/V apart (model/kv_layout.py) gives each sequence a block
table per KV group; the batch then has per group its own slot mapping and tables: `kv_group(g)` is the batch
as group g's layers see it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch


@dataclass
class SequenceChunk:
    """Tokens token_ids[start:] of a sequence, run through the model this step."""

    token_ids: Sequence[int]  # only token_ids[start:] are run; earlier ones are already in the cache
    start: int
    block_table: Sequence[int]
    need_logits: bool = True  # logits of the last token
    num_logits: int = 1  # with need_logits: of the last this many tokens (speculative decoding's verification)
    all_logits: bool = False  # logits of every token (evaluation)
    lora_slot: int = -1  # the LoRA adapter's slot (churon.model.lora.LoraSlots); -1: none
    lora_scale: float = 1.0  # multiplies the adapter's delta (the request's lora_scale)
    group_tables: Sequence[Sequence[int]] = ()  # the block tables of KV groups 1, 2, ... (block_table: group 0's)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    slot_mapping: torch.Tensor  # int64 [tokens]: block_table[pos // block_size] * block_size + pos % block_size
    query_start: list[int]  # [seqs + 1]: sequence i's tokens are flat rows query_start[i]:query_start[i + 1]
    context_lens: list[int]  # [seqs]: keys the sequence's last token attends to (start + new tokens)
    block_tables: torch.Tensor  # int32 [seqs, max_blocks] (padded with 0)
    logits_indices: torch.Tensor  # int64: flat rows whose logits are returned
    # per token, for kernels that attend each query token on its own: its sequence's block table
    # and how many keys it sees (its position + 1)
    token_block_tables: torch.Tensor  # int32 [tokens, max_blocks]
    token_context_lens: torch.Tensor  # int32 [tokens]
    # per token, when some sequence runs under a LoRA adapter: its slot (-1: none) and scale; both None
    # otherwise, so a step without adapters pays nothing for them
    lora_slots: torch.Tensor | None = None  # int32 [tokens]
    lora_scales: torch.Tensor | None = None  # float32 [tokens]
    # the batch as KV groups 1, 2, ... see it (their slot mappings and block tables); the batch itself is group 0's
    group_views: list["ForwardBatch"] = field(default_factory=list)
    # every KV group's slot mapping int64 [groups, tokens] and per-token tables int32 [groups, tokens, max_blocks]
    # at once (a group's view holds its row of each): what a whole-stack native call reads
    kv_slot_mappings: torch.Tensor | None = None
    kv_token_tables: torch.Tensor | None = None

    def kv_group(self, group: int) -> "ForwardBatch":
        return self.group_views[group - 1] if group else self

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @classmethod
    def build(cls, chunks: Sequence[SequenceChunk], block_size: int) -> "ForwardBatch":
        ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        logits_indices: list[int] = []
        for i, c in enumerate(chunks):
            end = len(c.token_ids)
            if not 0 <= c.start < end:
                raise ValueError(f"sequence chunk {i}: start {c.start} outside its {end} tokens")
            short = min(len(t) for t in (c.block_table, *c.group_tables))
            if -(-end // block_size) > short:
                raise ValueError(f"sequence chunk {i}: {end} tokens need more than its {short} blocks")
            if c.lora_slot < -1:
                raise ValueError(f"sequence chunk {i}: LoRA slot {c.lora_slot} (a slot is >= 0, or -1 for none)")
            ids.extend(c.token_ids[c.start :])
            positions.extend(range(c.start, end))
            context_lens.append(end)
            if c.all_logits:
                logits_indices.extend(range(query_start[-1], query_start[-1] + end - c.start))
            elif c.need_logits:
                if not 1 <= c.num_logits <= end - c.start:
                    raise ValueError(f"sequence chunk {i}: logits of its last {c.num_logits} tokens of {end - c.start}")
                logits_indices.extend(range(query_start[-1] + end - c.start - c.num_logits, query_start[-1] + end - c.start))
            query_start.append(query_start[-1] + end - c.start)
        num_groups = 1 + len(chunks[0].group_tables)
        if any(len(c.group_tables) != num_groups - 1 for c in chunks):
            raise ValueError("the sequence chunks of a batch must have one block table per KV group each")
        seq_of_token = [i for i, c in enumerate(chunks) for _ in range(c.start, len(c.token_ids))]
        slot_mappings, block_tables, token_block_tables = _kv_tables(chunks, num_groups, block_size, seq_of_token)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        lora_slots = lora_scales = None
        if any(c.lora_slot >= 0 for c in chunks):
            lora_slots = torch.tensor([chunks[i].lora_slot for i in seq_of_token], dtype=torch.int32)
            lora_scales = torch.tensor([chunks[i].lora_scale for i in seq_of_token], dtype=torch.float32)
        batch = cls(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=positions_t,
            slot_mapping=slot_mappings[0],
            query_start=query_start,
            context_lens=context_lens,
            block_tables=block_tables[0],
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            token_block_tables=token_block_tables[0],
            token_context_lens=(positions_t + 1).to(torch.int32),
            lora_slots=lora_slots,
            lora_scales=lora_scales,
            kv_slot_mappings=slot_mappings,
            kv_token_tables=token_block_tables,
        )
        batch.group_views = [replace(batch, slot_mapping=slot_mappings[g], block_tables=block_tables[g],
                                     token_block_tables=token_block_tables[g], group_views=[], kv_slot_mappings=None,
                                     kv_token_tables=None)
                             for g in range(1, num_groups)]
        return batch


def _kv_tables(chunks: Sequence[SequenceChunk], num_groups: int, block_size: int,
               seq_of_token: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every KV group's slot mapping [groups, tokens], block tables [groups, seqs, max_blocks] (padded with 0) and
    per-token tables [groups, tokens, max_blocks], from each chunk's table in each group; a group's are rows of
    these, contiguous."""
    # plain Python, one tensor each for all groups: a few small torch ops per sequence took 2.8 ms of a
    # 64-sequence decode step, this 0.6 ms; one tensor per group cost Gemma 3's six groups 0.1 ms a decode step
    max_blocks = max(len(t) for c in chunks for t in (c.block_table, *c.group_tables))
    padded: list[list[list[int]]] = []
    slots: list[list[int]] = []
    for g in range(num_groups):
        padded.append([])
        slots.append([])
        for c in chunks:
            table = list(c.block_table if g == 0 else c.group_tables[g - 1])
            padded[g].append(table + [0] * (max_blocks - len(table)))
            slots[g].extend(table[pos // block_size] * block_size + pos % block_size
                            for pos in range(c.start, len(c.token_ids)))
    block_tables = torch.tensor(padded, dtype=torch.int32)
    if len(seq_of_token) == len(chunks):  # one token a sequence (decode): a token's table is its sequence's
        return torch.tensor(slots, dtype=torch.int64), block_tables, block_tables
    return torch.tensor(slots, dtype=torch.int64), block_tables, block_tables[:, seq_of_token].contiguous()


@dataclass
class PackedBatch:
    """Whole inputs laid end to end for a forward that keeps no cache (embeddings): input i is flat rows
    seq_starts[i]:seq_starts[i + 1], its tokens at positions 0, 1, 2, ..."""

    input_ids: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    seq_starts: torch.Tensor  # int64 [inputs + 1]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> list[int]:
        return self.seq_starts.diff().tolist()

    @classmethod
    def build(cls, inputs: Sequence[Sequence[int]]) -> "PackedBatch":
        if not inputs or any(len(ids) == 0 for ids in inputs):
            raise ValueError("a packed batch needs at least one input, each of at least one token")
        lengths = torch.tensor([len(ids) for ids in inputs])
        starts = torch.zeros(len(inputs) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=starts[1:])
        return cls(
            input_ids=torch.tensor([t for ids in inputs for t in ids], dtype=torch.int64),
            positions=torch.arange(int(starts[-1])) - torch.repeat_interleave(starts[:-1], lengths),
            seq_starts=starts,
        )


def slots_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV-cache slots (int64) of a sequence's token positions, through its block table."""
    return block_table[positions // block_size].long() * block_size + positions % block_size
