"""NgramProposer (prompt lookup): hand-computed proposals, and incremental use against a brute-force reference."""

from __future__ import annotations

import gc
import random

import pytest

from churon.engine.sequence import Sequence
from churon.engine.speculative.ngram import CANDIDATES, MAX_AGREEMENT, NgramProposer, agreement


def propose(tokens: list[int], num_tokens: int, ngram_min: int = 2, ngram_max: int = 3) -> list[int]:
    """One proposal for a fresh sequence of these tokens."""
    return NgramProposer(ngram_min, ngram_max).propose(Sequence(tokens), num_tokens)


def reference(tokens: list[int], num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The definition, searched by brute force: longest suffix first; of its occurrences ending before the end, the
    latest CANDIDATES, the one whose context agrees with the end's longest (counted token by token up to
    MAX_AGREEMENT), the latest on a tie; as many of the tokens after it as agree, at most num_tokens, continued by
    the copy itself where they run out (so a period-p loop goes on looping)."""
    end = len(tokens)
    for n in range(ngram_max, ngram_min - 1, -1):
        found = [e for e in range(end - 1, n - 1, -1) if tokens[e - n : e] == tokens[end - n :]][:CANDIDATES]
        if found:
            def agree(e: int) -> int:
                length = 0
                while length < min(e, MAX_AGREEMENT) and tokens[e - 1 - length] == tokens[end - 1 - length]:
                    length += 1
                return length

            e = max(found, key=lambda e: (agree(e), e))
            extended = list(tokens)
            while len(extended) < end + num_tokens:
                extended.append(extended[e + len(extended) - end])
            return extended[end : end + min(num_tokens, agree(e))]
    return []


def test_longest_match_first():
    tokens = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at 0..2, followed by 9, the 2-gram (2, 3) also at 4..5: the longer wins
    assert propose(tokens, 4, ngram_max=3) == [9, 2, 3]  # three tokens agree: three proposed


def test_the_occurrence_whose_context_agrees_longest_wins():
    tokens = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
    # (2, 3) ends at 3 and at 6: at 6 the token before is 9, not the end's 1 (an agreement of 2), at 3 it is 1
    # (an agreement of 3, all the tokens before it): the earlier one wins
    assert propose(tokens, 4, ngram_max=2) == [9, 2, 3]


def test_latest_earlier_occurrence_wins_a_tie():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose(tokens, 2) == [2, 5]  # (5, 6) at 3..4 agrees no longer than at 0..1 and is later


def test_a_proposal_is_as_long_as_the_agreement_and_loops_past_the_end():
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    # (3, 1, 2) ends at 5 and all five tokens before 5 agree with the end; three follow it: the copy goes on as the
    # loop (3, 1, 2) of period 3, five tokens of it
    assert propose(tokens, 5) == [3, 1, 2, 3, 1]
    assert propose(tokens, 8) == [3, 1, 2, 3, 1]


def test_the_suffix_never_matches_itself():
    assert propose([1, 2, 3], 4, ngram_min=1) == []  # every n-gram ending at 3 occurs only as the suffix
    assert propose([1, 2], 4, ngram_min=2) == []
    # (4, 4) also ends at 2, one before the suffix: the one token after it, a loop of period 1, as long as the
    # agreement (the two tokens before 2)
    assert propose([4, 4, 4], 4, ngram_min=2, ngram_max=2) == [4, 4]


def test_num_tokens_cuts_the_proposal():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]  # (2, 3, 4) at 1..3, with the 1 before it: an agreement of 4
    assert propose(tokens, 1) == [5]
    assert propose(tokens, 3) == [5, 6, 7]
    assert propose(tokens, 6) == [5, 6, 7, 1]
    assert propose(tokens, 0) == []


def test_shorter_than_ngram_min_proposes_nothing():
    assert propose([7], 4, ngram_min=2) == []
    assert propose([7, 7], 4, ngram_min=2) == []  # the only 2-gram is the suffix
    assert propose([7, 7], 4, ngram_min=1) == [7]


def test_agreement_is_counted_up_to_its_bound():
    assert agreement([4] * 100, 99, 2) == MAX_AGREEMENT
    assert agreement([4] * 100, 20, 2) == 20  # no tokens before the occurrence's start
    tokens = [8] + [4] * 40 + [9] + [4] * 40
    assert agreement(tokens, 41, 3) == 40  # the 8 before 1..40 is not the 9 before 42..81


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
            num_tokens = rng.randint(0, 8)
            expected = reference(seq.token_ids, num_tokens, ngram_min, ngram_max)
            assert proposer.propose(seq, num_tokens) == expected, (seq.token_ids, num_tokens, ngram_min, ngram_max)
        proposer.drop(seq.seq_id)


def test_the_index_gives_the_garbage_collector_nothing_to_walk():
    # a long prompt's index: its keys are tuples of ints (untracked once collected), its chains ints in dicts
    tokens = random.Random(5).choices(range(50_000), k=5_000)
    gc.collect()
    before = len(gc.get_objects())
    proposer = NgramProposer(2, 4)
    proposer.propose(Sequence(tokens), 8)
    gc.collect()
    assert len(gc.get_objects()) - before < 100


def test_ngram_max_is_bounded():
    with pytest.raises(ValueError, match="ngram_max must be at most 64"):
        NgramProposer(2, 65)
