"""DraftProposer: a smaller model with the target's vocabulary guesses each decoding sequence's next tokens.

The draft model runs greedily on a KV cache of its own (its own PagedKVCache and BlockManager, no prefix caching),
one shadow Sequence per target sequence, under the target's seq_id: the shadow's token_ids are exactly the tokens
the draft has been fed, all of them computed. Each step, for every sequence asked for k tokens:

    rollback   the shadow keeps its common prefix with the target's token_ids (its proposals the target rejected
               go, BlockManager.truncate), always less the target's last token, whose logits give the first guess
    catch-up   one forward for every sequence at once: what the shadow lacks of the target's token_ids (the whole
               prompt at first, then the tokens accepted since and the target's own last draw) -> guess 1
    rounds     k - 1 single-token forwards, each over the sequences still wanting tokens: guess i -> guess i + 1

The last guess is never fed: if the target accepts it, the next catch-up runs it. Blocks for the catch-up are taken
for every sequence before any for the rounds, so one sequence's long proposal never costs another its guesses; a
sequence whose catch-up cannot have blocks gets no proposal and gives back the ones it held (its shadow starts over
next time). Proposals end where the draft would have to be fed a position past its context length, and after one
of the sequence's stop tokens (the target ends the sequence there if it accepts it).

A proposal only ever costs time: the target verifies every token (engine/speculative/__init__.py), so a draft that
guesses badly, even one whose logits are NaN, changes how many steps an output takes, never the output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from churon.engine.block_manager import BlockManager
from churon.engine.kv_cache import PagedKVCache
from churon.engine.sequence import Sequence
from churon.model.batch import ForwardBatch, SequenceChunk
from churon.model.transformer import Transformer

if TYPE_CHECKING:
    from churon.tokenizer import Tokenizer


def check_same_vocabulary(target: Tokenizer, draft: Tokenizer, source: str) -> None:
    """Raise ValueError unless the draft's tokenizer is the target's: the same bytes for every token id, the same
    end-of-generation and BOS ids. A token id is all a proposal passes on, so it must mean the same in both."""

    def differs(what: str) -> ValueError:
        return ValueError(f"draft model {source}: {what}; a draft model must share the target's tokenizer")

    if draft.vocab_size != target.vocab_size:
        raise differs(f"its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}")
    for token in range(target.vocab_size):
        mine, theirs = draft.token_bytes(token), target.token_bytes(token)
        if mine != theirs:
            raise differs(
                f"its vocabulary differs from the target's: token {token} is {mine!r} in the draft, {theirs!r} in"
                " the target model"
            )
    if draft.eog_ids != target.eog_ids:
        raise differs(f"its end-of-generation tokens {sorted(draft.eog_ids)} are not the target's {sorted(target.eog_ids)}")
    if draft.bos_id != target.bos_id:
        raise differs(f"its BOS token is {draft.bos_id}, the target's {target.bos_id}")


class DraftProposer:
    """Greedy proposals of a draft model, batched over the decoding sequences, on the draft's own KV cache."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, kv_dtype: torch.dtype, vocab_size: int):
        """vocab_size: the ids a guess may be, the ones both models have logits for (one model's may be padded)."""
        self.model = model
        self.vocab_size = vocab_size
        self.cache = PagedKVCache(model.config, num_blocks, block_size, kv_dtype)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._shadows: dict[int, Sequence] = {}  # target seq_id -> the tokens the draft has been fed

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used_blocks

    def propose(self, wanted: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """For each (target sequence, k): up to k greedy tokens of the draft model continuing seq.token_ids
        (fewer, or none, where blocks or the draft's context run out, or after a stop token); every seq_id gets
        an entry. Only the draft's own cache changes, never the target's."""
        bm = self.block_manager
        proposals: dict[int, list[int]] = {}
        planned: list[tuple[Sequence, Sequence, int]] = []  # (target, shadow, tokens to propose)
        for seq, k in wanted:
            proposals[seq.seq_id] = []
            # guess i (from 0) takes position num_tokens + i: only positions below the draft's context length
            room = self.model.config.context_length - seq.num_tokens
            if room < 1:
                self.drop(seq.seq_id)  # the sequence only grows: the draft has nothing more for it
            elif k >= 1:
                planned.append((seq, self._rolled_back(seq), min(k, room)))
        ready: list[tuple[Sequence, Sequence, int]] = []
        for seq, shadow, num in planned:
            if bm.allocate(shadow, shadow.num_uncomputed_tokens):
                ready.append((seq, shadow, num))
            else:  # no proposal, and the blocks it held go to the others; it starts over when there is room
                self.drop(seq.seq_id)
        if not ready:
            return proposals
        for i, (seq, shadow, num) in enumerate(ready):
            # the catch-up's blocks are held: the rounds get what is left, guess 1 needs none
            capacity = (len(shadow.block_table) + bm.num_free_blocks) * bm.block_size
            num = min(num, capacity - shadow.num_tokens + 1)
            bm.allocate(shadow, shadow.num_uncomputed_tokens + num - 1)  # fits: no prefix cache, so no hits to count
            ready[i] = (seq, shadow, num)

        chunks = [SequenceChunk(shadow.token_ids, shadow.num_computed_tokens, shadow.block_table) for _, shadow, _ in ready]
        for (_, shadow, _), token in zip(ready, self._greedy(chunks), strict=True):
            bm.commit(shadow, shadow.num_uncomputed_tokens)
            proposals[shadow.seq_id].append(token)
        while True:
            going = [
                (seq, shadow) for seq, shadow, num in ready
                if len(proposals[seq.seq_id]) < num and proposals[seq.seq_id][-1] not in seq.stop_token_ids
            ]
            if not going:
                break
            for seq, shadow in going:
                shadow.token_ids.append(proposals[seq.seq_id][-1])
            chunks = [SequenceChunk(shadow.token_ids, shadow.num_tokens - 1, shadow.block_table) for _, shadow in going]
            for (seq, shadow), token in zip(going, self._greedy(chunks), strict=True):
                bm.commit(shadow, 1)
                proposals[seq.seq_id].append(token)
        for _, shadow, _ in ready:
            bm.truncate(shadow, shadow.num_tokens)  # the blocks of rounds a stop token cut short go back
        return proposals

    def drop(self, seq_id: int) -> None:
        """Forget seq_id: its draft blocks go back."""
        shadow = self._shadows.pop(seq_id, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def _rolled_back(self, seq: Sequence) -> Sequence:
        """seq's shadow with its tokens = seq.token_ids, of which those the draft already ran for seq (its
        common prefix, less seq's last token) count as computed."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self._shadows[seq.seq_id] = Sequence(seq.token_ids, seq_id=seq.seq_id)
            return shadow
        keep = min(_common_prefix_length(shadow.token_ids, seq.token_ids), seq.num_tokens - 1)
        self.block_manager.truncate(shadow, keep)
        del shadow.token_ids[keep:]
        shadow.token_ids.extend(seq.token_ids[keep:])
        return shadow

    def _greedy(self, chunks: list[SequenceChunk]) -> list[int]:
        """One forward of the chunks; each one's greedy next token (the first index of the maximum, as
        Sampler's greedy draw takes it, over the ids both models know, not the backend's padding columns)."""
        logits = self.model.forward_batch(ForwardBatch.build(chunks, self.cache.block_size), self.cache)
        return logits[:, : self.vocab_size].numpy().argmax(axis=1).tolist()


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share. A bisection over slice comparisons: each comparison is one C loop, so
    a shadow's few thousand tokens cost a dozen Python steps, not one per token."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low
