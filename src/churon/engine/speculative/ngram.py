"""NgramProposer: prompt lookup, proposals copied from the sequence's own earlier tokens.

Output often repeats what came before: code being edited, a document being quoted or summarized,
a list of names, a repeated phrase. When the last n tokens of a sequence occurred earlier in it
(prompt or output), the tokens that followed that occurrence are a cheap guess at what comes next.
The longest suffix that matches wins (n = ngram_max down to ngram_min), and of its occurrences the
latest one: it is the nearest context. The occurrence must end before the sequence does, so the
suffix never matches itself and at least one token follows it. Where the tokens after it run into the
sequence's end, the proposal goes on as the repetition it implies (an output looping with period p
continues its loop), so it always has num_tokens tokens.

Each sequence keeps an index, n-gram -> end of its latest occurrence, for every n in
[ngram_min, ngram_max]. token_ids only ever grows (rejected proposals are never appended), so each
call indexes just the tokens added since the last one: O(new tokens * (ngram_max - ngram_min + 1))
dictionary updates, then one look-up per n at most. The n-grams ending at the last token are indexed
one call later, once a later suffix can match them.
"""

from __future__ import annotations

from churon.engine.sequence import Sequence


class _Index:
    """One sequence's n-grams: the tuple of n tokens -> the end (exclusive) of its latest occurrence,
    over the occurrences ending before position num_indexed."""

    __slots__ = ("latest", "num_indexed")

    def __init__(self):
        self.latest: dict[tuple[int, ...], int] = {}  # tuples of different lengths never collide: one dict
        self.num_indexed = 0


class NgramProposer:
    """Prompt lookup."""

    def __init__(self, ngram_min: int, ngram_max: int):
        """1 <= ngram_min <= ngram_max (SpeculativeConfig checks them)."""
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._indexes: dict[int, _Index] = {}  # seq_id -> its index

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens: find the latest earlier occurrence of seq.token_ids' last n tokens
        (n = ngram_max down to ngram_min, longest match first) in seq.token_ids (prompt + output so far) and
        return the num_tokens tokens that followed it, continued as a loop where the sequence ends first; [] when
        nothing matches."""
        if num_tokens <= 0:  # the index catches up on the next call that wants tokens
            return []
        tokens = seq.token_ids
        end = len(tokens)
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = _Index()
        latest = index.latest
        low, high = self.ngram_min, self.ngram_max
        # occurrences ending at e < end; the one ending at `end` is the suffix itself
        for e in range(max(index.num_indexed, low), end):
            for n in range(low, min(high, e) + 1):
                latest[tuple(tokens[e - n : e])] = e
        index.num_indexed = end
        for n in range(min(high, end - 1), low - 1, -1):
            e = latest.get(tuple(tokens[end - n :]))
            if e is not None:  # what followed, continued as a loop of period end - e past the sequence's end
                period = end - e
                return [tokens[e + i % period] for i in range(num_tokens)]
        return []

    def drop(self, seq_id: int) -> None:
        """forget seq_id's index"""
        self._indexes.pop(seq_id, None)
