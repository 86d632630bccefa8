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

from typing import TYPE_CHECKING

from churon.config import SpeculativeConfig
from churon.engine.sequence import Sequence
from churon.engine.speculative.adaptive import AdaptiveLength
from churon.engine.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from churon.engine.speculative.draft import DraftProposer

# A step's cost is about T0 + rows * r: the weights are read once per pass (T0), each row adds its arithmetic, its lm_head
# product and its attention (r). This is r / T0, measured with SmolLM2 on 2 threads of a Zen 4 EPYC: 1 row at ~700 tokens
# of context 7.6 ms, 9 rows of one sequence 18.3 ms (0.22); a batch of 8 decoding requests 15.8 ms a step, 1 alone 6.5 ms
# (0.26)
ROW_COST = 0.2


class Speculator:
    """The proposals of one engine's decoding sequences, each sequence's proposal length, and the counters."""

    def __init__(self, config: SpeculativeConfig, draft: DraftProposer | None = None, draft_cost: float = 0.0):
        """draft: the draft-model proposer (method "draft"); draft_cost: a draft token's cost relative to a target
        decode step (the weights each reads per token)."""
        self.config = config
        self.proposer = draft if draft is not None else NgramProposer(config.ngram_min, config.ngram_max)
        self.draft_cost = draft_cost
        self._lengths: dict[int, AdaptiveLength] = {}
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verifications = 0

    def propose(self, seqs: list[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Proposals for (decoding sequence, the most tokens it may take) pairs: seq_id -> tokens (only non-empty)."""
        # A proposed token's row, as a share of what its request's own row costs in a step of B decoding rows:
        # B * r / (T0 + B * r). Alone a row is cheap beside the weights' read; in a batch every row is a share of the
        # step, so a proposal must be accepted more often to pay. A draft's forward per token comes on top.
        batch = ROW_COST * len(seqs)
        cost = batch / (1 + batch) + self.draft_cost
        wanted = []
        for seq, limit in seqs:
            length = self._lengths.get(seq.seq_id)
            if length is None:
                length = self._lengths[seq.seq_id] = AdaptiveLength(self.config.num_tokens, self.config.adaptive)
            k = min(length.next(cost), limit)
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
