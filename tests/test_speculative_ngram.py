"""NgramProposer (prompt lookup): hand-computed proposals, and incremental use against a brute-force reference."""

from __future__ import annotations

import random

import pytest

from churon.engine.sequence import Sequence
from churon.engine.speculative.ngram import NgramProposer


def propose(tokens: list[int], num_tokens: int, ngram_min: int = 2, ngram_max: int = 3) -> list[int]:
    """One proposal for a fresh sequence of these tokens."""
    return NgramProposer(ngram_min, ngram_max).propose(Sequence(tokens), num_tokens)


def reference(tokens: list[int], num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The definition, searched by brute force: longest suffix first, latest occurrence ending before the end, the
    tokens after it continued by the copy itself where they run out (so a period-p loop goes on looping)."""
    end = len(tokens)
    for n in range(ngram_max, ngram_min - 1, -1):
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n : e] == tokens[end - n :]:
                extended = list(tokens)
                while len(extended) < end + num_tokens:
                    extended.append(extended[e + len(extended) - end])
                return extended[end : end + num_tokens]
    return []


def test_longest_match_first():
    tokens = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at 0..2, followed by 9; the later 2-gram (2, 3) at 4..5 is shorter
    assert propose(tokens, 4, ngram_max=3) == [9, 2, 3, 7]
    assert propose(tokens, 4, ngram_max=2) == [7, 1, 2, 3]


def test_latest_earlier_occurrence_wins_and_a_proposal_past_the_end_loops():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose(tokens, 2) == [2, 5]  # (5, 6) at 3..4 is later than at 0..1
    # only three tokens follow it: the copy goes on as the loop (2, 5, 6) of period 3
    assert propose(tokens, 5) == [2, 5, 6, 2, 5]


def test_the_suffix_never_matches_itself():
    assert propose([1, 2, 3], 4, ngram_min=1) == []  # every n-gram ending at 3 occurs only as the suffix
    assert propose([1, 2], 4, ngram_min=2) == []
    # (4, 4) also ends at 2, one before the suffix: the one token after it, a loop of period 1
    assert propose([4, 4, 4], 4, ngram_min=2, ngram_max=2) == [4, 4, 4, 4]


def test_num_tokens_cuts_the_proposal():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(tokens, 1) == [3]
    assert propose(tokens, 3) == [3, 4, 5]
    assert propose(tokens, 0) == []


def test_shorter_than_ngram_min_proposes_nothing():
    assert propose([7], 4, ngram_min=2) == []
    assert propose([7, 7], 4, ngram_min=2) == []  # the only 2-gram is the suffix
    assert propose([7, 7], 4, ngram_min=1) == [7, 7, 7, 7]


def test_output_tokens_are_looked_up_and_indexed_as_they_come():
    proposer = NgramProposer(2, 2)
    seq = Sequence([1, 2, 3])
    assert proposer.propose(seq, 2) == []
    seq.append_token(1)
    assert proposer.propose(seq, 2) == []
    seq.append_token(2)
    assert proposer.propose(seq, 2) == [3, 1]
    seq.append_token(8)
    seq.append_token(1)
    seq.append_token(2)  # two tokens at a time: the call indexes both
    assert proposer.propose(seq, 2) == [8, 1]


def test_drop_forgets():
    proposer = NgramProposer(2, 2)
    assert proposer.propose(Sequence([1, 2, 3, 1, 2], seq_id=7), 1) == [3]
    proposer.drop(7)
    # another sequence under the same id: a stale index would still place (1, 2) at 0..1, followed here by 2
    assert proposer.propose(Sequence([9, 1, 2, 4, 1, 2], seq_id=7), 1) == [4]
    proposer.drop(7)
    assert proposer._indexes == {}
    proposer.drop(7)  # a sequence that never proposed (or already dropped) is no error


@pytest.mark.parametrize("seed", range(4))
def test_incremental_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(500):  # 4 x 500 = 2,000 random sequences
        ngram_min = rng.randint(1, 3)
        ngram_max = rng.randint(ngram_min, 4)
        alphabet = rng.randint(2, 4)  # few symbols: many matches, overlapping and repeated
        proposer = NgramProposer(ngram_min, ngram_max)
        seq = Sequence(rng.choices(range(alphabet), k=rng.randint(1, 12)))
        for _ in range(rng.randint(1, 20)):
            for _ in range(rng.choice((1, 1, 1, 2, 3))):  # sometimes several tokens between calls
                seq.append_token(rng.randrange(alphabet))
            num_tokens = rng.randint(0, 6)
            expected = reference(seq.token_ids, num_tokens, ngram_min, ngram_max)
            assert proposer.propose(seq, num_tokens) == expected, (seq.token_ids, num_tokens, ngram_min, ngram_max)
        proposer.drop(seq.seq_id)
