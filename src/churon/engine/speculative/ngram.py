"""NgramProposer: prompt lookup, proposals copied from the sequence's own earlier tokens.

Output often repeats what came before: code being edited, a document being quoted or summarized,
a list of names, a repeated phrase. When the last n tokens of a sequence occurred earlier in it
(prompt or output), the tokens that followed that occurrence are a cheap guess at what comes next.
The longest suffix that matches wins (n = ngram_max down to ngram_min). Of its occurrences (the
latest CANDIDATES), the one whose context agrees with the sequence's longest wins, the latest on a
tie: the agreement of L tokens ending there (L >= n, counted up to MAX_AGREEMENT) says how much the
output is copying that place. The occurrence must end before the sequence does, so the suffix never
matches itself and at least one token follows it. Where the tokens after it run into the sequence's
end, the proposal goes on as the repetition it implies (an output looping with period p continues its
loop).

A proposal is at most L tokens long. An agreement of two or three tokens is a weak guess (a common
phrase, a line of code that starts like another): on the input-grounded workload of
benchmarks/bench_speculative.py, proposals of 8 after an agreement of 2 had 2 of them accepted on
average, half of them none, where after an agreement of 16 or more 7.5 of 8 were. Each proposed token
is a row of the verification step, which costs a fraction of the step whether accepted or not; cut to
L (and taken from the best-agreeing occurrence), that workload's proposed tokens went from 1,933 to 1,717
for 1,430 -> 1,425 accepted, its decoding 3.4% less time (docs/BENCHMARKS.md).

Each sequence keeps an index, n-gram -> the end of its latest occurrence and each occurrence -> the
one before, for every n in [ngram_min, ngram_max]. token_ids only ever grows (rejected proposals are
never appended), so each call indexes just the tokens added since the last one: O(new tokens *
(ngram_max - ngram_min + 1)) dictionary updates, then one look-up per n at most and CANDIDATES
agreements measured by slice comparison. The n-grams ending at the last token are indexed one call
later, once a later suffix can match them.
"""

from __future__ import annotations

from churon.engine.sequence import Sequence


CANDIDATES = 8  # the latest occurrences of the matched n-gram whose agreement is measured
MAX_AGREEMENT = 64  # agreement counted up to this many tokens: past it, the occurrences are alike
STRIDE = 65  # _Index.earlier's key per end: n <= 64 (SpeculativeConfig's bound on ngram_max)


class _Index:
    """One sequence's n-grams, over the occurrences ending before position num_indexed: the tuple of n tokens ->
    the end (exclusive) of its latest occurrence, and for each occurrence the end of the one before it (chains of
    ints: lists of ends would be ~3 objects a token for the garbage collector to walk, 100,000 for a long prompt)."""

    __slots__ = ("latest", "earlier", "num_indexed")

    def __init__(self):
        self.latest: dict[tuple[int, ...], int] = {}  # tuples of different lengths never collide: one dict
        self.earlier: dict[int, int] = {}  # e * STRIDE + n -> where the n tokens ending at e occurred before
        self.num_indexed = 0


def agreement(tokens: list[int], e: int, n: int) -> int:
    """How many tokens before e agree with the last ones of tokens (the common suffix of tokens[:e] and tokens,
    n <= it <= MAX_AGREEMENT, given that the last n agree), found by doubling and then halving the length of
    the slices compared."""
    end = len(tokens)
    good, step = n, n
    limit = min(MAX_AGREEMENT, e)
    while good < limit:  # doubling: find a length that disagrees
        size = min(good + step, limit)
        if tokens[e - size : e] != tokens[end - size :]:
            break
        good, step = size, 2 * step
    else:
        return good
    bad = min(good + step, limit)
    while bad - good > 1:  # the longest agreeing length in (good, bad)
        mid = (good + bad) // 2
        if tokens[e - mid : e] == tokens[end - mid :]:
            good = mid
        else:
            bad = mid
    return good


class NgramProposer:
    """Prompt lookup."""

    def __init__(self, ngram_min: int, ngram_max: int):
        """1 <= ngram_min <= ngram_max <= 64 (SpeculativeConfig checks them; the index's keys rely on the last)."""
        if ngram_max >= STRIDE:
            raise ValueError(f"ngram_max must be at most {STRIDE - 1}, got {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._indexes: dict[int, _Index] = {}  # seq_id -> its index

    def propose(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Up to num_tokens tokens: find the earlier occurrences of seq.token_ids' last n tokens (n = ngram_max
        down to ngram_min, longest match first) in seq.token_ids (prompt + output so far), take the one of the
        latest CANDIDATES whose context agrees longest (L tokens; the latest on a tie) and return the
        min(num_tokens, L) tokens that followed it, continued as a loop where the sequence ends first; [] when
        nothing matches."""
        if num_tokens <= 0:  # the index catches up on the next call that wants tokens
            return []
        tokens = seq.token_ids
        end = len(tokens)
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = _Index()
        latest, earlier = index.latest, index.earlier
        low, high = self.ngram_min, self.ngram_max
        # occurrences ending at e < end; the one ending at `end` is the suffix itself
        for e in range(max(index.num_indexed, low), end):
            for n in range(low, min(high, e) + 1):
                key = tuple(tokens[e - n : e])
                before = latest.get(key)
                if before is not None:
                    earlier[e * STRIDE + n] = before
                latest[key] = e
        index.num_indexed = end
        for n in range(min(high, end - 1), low - 1, -1):
            e = latest.get(tuple(tokens[end - n :]))
            if e is not None:
                best, longest = e, 0
                for _ in range(CANDIDATES):  # latest first: an earlier one wins only by agreeing longer
                    length = agreement(tokens, e, n)
                    if length > longest:
                        best, longest = e, length
                    e = earlier.get(e * STRIDE + n)
                    if e is None:
                        break
                # what followed, continued as a loop of period end - best past the sequence's end
                period = end - best
                return [tokens[best + i % period] for i in range(min(num_tokens, longest))]
        return []

    def drop(self, seq_id: int) -> None:
        """forget seq_id's index"""
        self._indexes.pop(seq_id, None)
