"""ModelRunner: executes what the scheduler decided, on the model and the KV-cache memory.

scheduled sequences (and their proposed tokens) -> ForwardBatch (positions, slot mappings, block tables, LoRA
slots) -> model -> logits
"""

from __future__ import annotations

from typing import Sequence

import torch

from churon.engine.kv_cache import PagedKVCache
from churon.engine.scheduler import ScheduledSeq
from churon.model.batch import ForwardBatch, SequenceChunk
from churon.model.transformer import Transformer


class ModelRunner:
    def __init__(self, model: Transformer, cache: PagedKVCache):
        self.model = model
        self.cache = cache

    def execute(self, scheduled: list[ScheduledSeq], all_logits: Sequence[bool] | None = None,
                argmax_only: bool = False) -> torch.Tensor:
        """Run one step; float32 logits in the order of `scheduled`: every row of the sequences
        all_logits marks (prompt logprobs), else for each sequence that samples the row of its last token and
        those of the tokens proposed after it (speculative decoding). argmax_only: every row is read for its first
        maximum alone (Transformer.forward_batch)."""
        all_logits = all_logits or [False] * len(scheduled)
        chunks = [
            SequenceChunk(
                s.seq.token_ids[: s.start + s.num_tokens] + s.draft, s.start, s.seq.block_tables[0], need_logits=s.sample,
                num_logits=1 + len(s.draft), all_logits=every, lora_slot=s.seq.lora_slot, lora_scale=s.seq.lora_scale,
                group_tables=s.seq.block_tables[1:],
            )
            for s, every in zip(scheduled, all_logits, strict=True)
        ]
        batch = ForwardBatch.build(chunks, self.cache.block_size)
        return self.model.forward_batch(batch, self.cache, argmax_only)
