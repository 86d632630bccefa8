"""AdaptiveLength: the proposal length with the most tokens per cost; back-off and probes where none is accepted."""

from __future__ import annotations

import random

from churon.engine.speculative.adaptive import AdaptiveLength


def back_off(length: AdaptiveLength) -> int:
    """The steps next() says 0 in a row, up to the probe of 1 that ends them."""
    steps = 0
    while (k := length.next(0.1)) == 0:
        steps += 1
        assert steps <= 64
    assert k == 1
    return steps


def test_not_adaptive_always_proposes_max_tokens():
    length = AdaptiveLength(5, adaptive=False)
    for _ in range(100):
        assert length.next(0.1) == 5 and length.next(5.0) == 5
        length.update(5, 0)


def test_starts_speculating_optimistically():
    # a = 0.6, cost 0.1 per token: tokens per cost 1, 1.6/1.1 = 1.455, 1.96/1.2 = 1.633, 2.176/1.3 = 1.674,
    # 2.3056/1.4 = 1.647, ... so 3
    assert AdaptiveLength(8).next(0.1) == 3


def test_all_accepted_proposes_max_tokens():
    length = AdaptiveLength(8)
    for _ in range(20):
        k = length.next(0.1)
        length.update(k, k)
    assert [length.next(0.1) for _ in range(10)] == [8] * 10


def test_middling_rate_picks_the_best_tokens_per_cost():
    # every verification keeps 1 of the 2 positions it tries: a -> 0.5. Tokens per cost with k proposed:
    # k=0: 1, k=1: 1.5/1.1 = 1.364, k=2: 1.75/1.2 = 1.458, k=3: 1.875/1.3 = 1.442, k=4: 1.9375/1.4 = 1.384
    half = AdaptiveLength(8)
    for _ in range(60):
        half.update(8, 1)
    assert half.next(0.1) == 2
    # 4 of 5: a -> 0.8. k=5: 3.6893/1.5 = 2.4595, k=6: 3.9514/1.6 = 2.4697, k=7: 4.1611/1.7 = 2.4477
    most = AdaptiveLength(8)
    for _ in range(60):
        most.update(5, 4)
    assert most.next(0.1) == 6
    # the same rate at a higher cost per token, 0.3 (a bigger batch): k=1: 1.8/1.3 = 1.385, k=2: 2.44/1.6 = 1.525,
    # k=3: 2.952/1.9 = 1.554, k=4: 3.3616/2.2 = 1.528
    assert most.next(0.3) == 3


def test_never_accepted_backs_off_and_probes():
    length = AdaptiveLength(4)
    lengths = []
    while (k := length.next(0.1)) > 0:
        lengths.append(k)
        length.update(k, 0)
        assert len(lengths) <= 5  # off after a few rejections
    assert lengths == sorted(lengths, reverse=True)
    # 4 steps off (this call was the first of them), then exactly one probe of 1
    assert 1 + back_off(length) == 4
    assert length.next(0.1) == 1  # the probe stays pending until a verification reports on it
    backoffs = []
    for _ in range(6):
        length.update(1, 0)
        backoffs.append(back_off(length))
    assert backoffs == [8, 16, 32, 64, 64, 64]

    length.update(1, 1)  # an accepted probe: the back-off starts over at 4
    steps = 0
    while (k := length.next(0.1)) > 0:
        length.update(k, 0)
        steps += 1
        assert steps <= 10
    assert 1 + back_off(length) == 4


def test_deterministic():
    rng = random.Random(0)
    history = [rng.random() for _ in range(300)]  # each step's acceptance chance
    runs = []
    for _ in range(2):
        length, ks = AdaptiveLength(6), []
        for chance in history:
            k = length.next(0.08)
            ks.append(k)
            if k:
                accepted = 0
                while accepted < k and chance > 0.3 + 0.1 * accepted:
                    accepted += 1
                length.update(k, accepted)
        runs.append(ks)
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 2  # the history moved it around


def test_a_cost_of_one_or_more_never_speculates():
    # (k + 1) / (1 + cost * k) <= 1 at cost >= 1: even all-accepted proposals would not pay (a draft as big as the
    # model), so no k, not even a probe, whatever the history
    length = AdaptiveLength(4)
    for _ in range(10):
        length.update(4, 4)
    assert [length.next(1.0) for _ in range(200)] == [0] * 200
    assert length.next(0.1) == 4  # a cheap step again (a smaller batch): the history still counts
