"""Speculative decoding: a decoding request proposes tokens, the target model scores them in the step's one pass.

Each step, before scheduling, the Speculator asks the proposer for each decoding sequence's next tokens (prompt
lookup, ngram.py, or a draft model, draft.py), as many as the sequence's AdaptiveLength (adaptive.py) finds worth
their cost. The scheduler runs them after the sequence's last token; the target's logits of those 1 + k rows come
back, and Request.verify samples each row exactly as decoding would, keeping proposals while they equal its own draws.

What is guaranteed. Every token of the output is the target model's own draw from the logits of the sequence so far
(computed bitwise the same in a verification pass as in a decode step: batch invariance) with the request's own
sampler state and generator, one draw per token as without speculation. So greedy outputs are bitwise the outputs
without speculation, and a seeded sampled request gives the same text with and without it, for both proposers: each
proposal is a point mass q (prompt lookup's copy, the draft's greedy token), for which standard speculative rejection
sampling (accept with min(1, p/q) = p(x), else draw from the normalized residual p without x) is exactly "draw from p,
accept when the draw is the proposal, else keep the draw". Proposals change only how many steps the output takes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from churon.config import SpeculativeConfig
from churon.engine.sequence import Sequence
from churon.engine.speculative.adaptive import AdaptiveLength
from churon.engine.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from churon.engine.speculative.draft import DraftProposer

# What a verification pass's extra row costs relative to a decode step: the weights are read once per pass, a row adds
# its own arithmetic and its lm_head product (churon's kernel benchmark: 4 rows cost 1.05-1.3x of one)
VERIFY_ROW_COST = 0.08


class Speculator:
    """The proposals of one engine's decoding sequences, each sequence's proposal length, and the counters."""

    def __init__(self, config: SpeculativeConfig, draft: DraftProposer | None = None, draft_cost: float = 0.0):
        """draft: the draft-model proposer (method "draft"); draft_cost: a draft token's cost relative to a target
        decode step (the weights each reads per token)."""
        self.config = config
        self.proposer = draft if draft is not None else NgramProposer(config.ngram_min, config.ngram_max)
        self.cost_per_token = VERIFY_ROW_COST + draft_cost
        self._lengths: dict[int, AdaptiveLength] = {}
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verifications = 0

    def propose(self, seqs: Iterable[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Proposals for (decoding sequence, the most tokens it may take) pairs: seq_id -> tokens (only non-empty)."""
        wanted = []
        for seq, limit in seqs:
            length = self._lengths.get(seq.seq_id)
            if length is None:
                length = self._lengths[seq.seq_id] = AdaptiveLength(
                    self.config.num_tokens, self.cost_per_token, self.config.adaptive
                )
            k = min(length.next(), limit)
            if k > 0:
                wanted.append((seq, k))
        if not wanted:
            return {}
        if isinstance(self.proposer, NgramProposer):
            proposals = {seq.seq_id: self.proposer.propose(seq, k) for seq, k in wanted}
        else:
            proposals = self.proposer.propose(wanted)
        return {seq_id: tokens for seq_id, tokens in proposals.items() if tokens}

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verification of `proposed` tokens kept the first `accepted` of them."""
        self._lengths[seq_id].update(proposed, accepted)
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_verifications += 1

    def drop(self, seq_id: int) -> None:
        """The request left the engine: its proposer state and length go."""
        self._lengths.pop(seq_id, None)
        self.proposer.drop(seq_id)
