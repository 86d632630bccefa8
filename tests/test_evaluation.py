"""The quality metrics in churon.evaluation on cases worked out by hand."""

import math

import pytest
import torch

from churon.engine.kv_cache import SequenceKVCache
from churon.evaluation import (
    ComparisonAccumulator,
    compare,
    compare_logits,
    compare_window,
    perplexity,
    perplexity_from_nll,
    scored_positions,
    text_windows,
    token_nll,
    window_logits,
)


def test_windows_are_consecutive_and_drop_the_tail():
    tokens = list(range(10))
    assert text_windows(tokens, ctx=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert text_windows(tokens, ctx=5) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert text_windows(tokens, ctx=4, max_windows=1) == [[0, 1, 2, 3]]
    assert text_windows(tokens, ctx=11) == []
    assert text_windows(tokens, ctx=4, bos_id=99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert tokens == list(range(10))  # the input is untouched
    with pytest.raises(ValueError, match="ctx=1"):
        text_windows(tokens, ctx=1)


def test_scored_positions_are_llamacpps_second_half():
    s = scored_positions(512)
    assert (s.start, s.stop) == (256, 511)
    assert len(range(512)[s]) == 255  # llama.cpp: n_ctx - 1 - n_ctx/2
    assert len(range(5)[scored_positions(5)]) == 2  # positions 2, 3 predict tokens 3, 4


def test_identical_logits_give_zero_kl_and_full_agreement():
    torch.manual_seed(0)
    logits = torch.randn(100, 1000) * 5
    stats = compare_logits(logits, logits.clone(), torch.randint(0, 1000, (100,)))
    assert torch.all(stats.kl == 0)
    assert stats.top1_match.all()
    assert torch.equal(stats.nll_ref, stats.nll_test)


def test_kl_of_a_known_pair():
    # P = (0.75, 0.25), Q = (0.5, 0.5): KL(P||Q) = 0.75 ln 1.5 + 0.25 ln 0.5
    p = torch.tensor([[math.log(3.0), 0.0]])
    q = torch.tensor([[0.0, 0.0]])
    stats = compare_logits(p, q, torch.tensor([1]))
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert stats.kl.dtype == torch.float64
    assert stats.kl.item() == pytest.approx(expected, rel=1e-6)
    # argmax of Q is index 0 (first of the tied maxima), argmax of P is 0 too
    assert stats.top1_match.item()
    assert stats.nll_ref.item() == pytest.approx(-math.log(0.25), rel=1e-6)
    assert stats.nll_test.item() == pytest.approx(math.log(2.0), rel=1e-6)
    # the other direction differs: KL(Q||P) = 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25)
    back = compare_logits(q, p).kl.item()
    assert back == pytest.approx(0.5 * math.log(2 / 3) + 0.5 * math.log(2.0), rel=1e-6)
    assert compare_logits(q, p).nll_ref is None


def test_top1_disagreement_is_counted():
    ref = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [0.0, 3.0, 1.0]])
    test = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    assert compare_logits(ref, test).top1_match.tolist() == [True, False, True]


def test_kl_is_exact_over_many_rows_and_chunks():
    torch.manual_seed(1)
    ref, test = torch.randn(150, 50), torch.randn(150, 50)  # more rows than one float64 chunk
    p, q = ref.double().softmax(-1), test.double().softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(compare_logits(ref, test).kl, expected, rtol=1e-10, atol=1e-12)


def test_perplexity_of_a_uniform_distribution_is_the_vocab_size():
    vocab = 321
    windows = text_windows(list(range(40)), ctx=8)
    assert perplexity(lambda w: torch.zeros(len(w), vocab), windows) == pytest.approx(vocab, rel=1e-9)
    nll = token_nll(torch.zeros(5, vocab), torch.tensor([0, 1, 2, 3, 4]))
    assert perplexity_from_nll(nll) == pytest.approx(vocab, rel=1e-9)


def test_perplexity_scores_only_the_second_half():
    # A model that puts probability 1/2 on the true next token in the scored half and 1/vocab elsewhere.
    vocab, ctx = 10, 8
    tokens = [(3 * i) % vocab for i in range(2 * ctx)]
    windows = text_windows(tokens, ctx=ctx)

    def model(window):
        logits = torch.zeros(len(window), vocab)
        for pos in range(len(window) - 1):
            if pos >= ctx // 2:
                logits[pos, window[pos + 1]] = math.log(vocab - 1)  # p = (V-1) / (2(V-1)) = 1/2
        return logits

    assert perplexity(model, windows) == pytest.approx(2.0, rel=1e-6)  # float32 log(V-1)


def test_compare_over_windows_summarizes_per_token_stats():
    torch.manual_seed(2)
    vocab, ctx = 30, 16
    windows = text_windows(torch.randint(0, vocab, (3 * ctx + 5,)).tolist(), ctx=ctx)
    table = {}

    def ref(w):
        return table.setdefault(("ref", tuple(w)), torch.randn(len(w), vocab))

    def test(w):
        return table.setdefault(("test", tuple(w)), torch.randn(len(w), vocab))

    result = compare(ref, test, windows)
    assert result.n_tokens == 3 * (ctx - 1 - ctx // 2)
    acc = ComparisonAccumulator()
    for w in windows:
        acc.add(compare_window(ref(w), test(w), w))
    assert acc.result() == result
    kl = torch.cat([compare_window(ref(w), test(w), w).kl for w in windows])
    assert result.mean_kl == pytest.approx(kl.mean().item())
    assert result.max_kl == kl.max().item()
    assert result.p99_kl == pytest.approx(torch.quantile(kl, 0.99).item())
    assert 0 <= result.top1_agreement <= 1
    assert result.ppl_ref > 1 and result.ppl_test > 1
    same = compare(ref, ref, windows)
    assert same.mean_kl == 0 and same.top1_agreement == 1 and same.ppl_ref == same.ppl_test
    assert set(result.as_dict()) >= {"mean_kl", "p99_kl", "max_kl", "top1_agreement", "n_tokens", "ppl_test", "ppl_ref"}


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="equal shapes"):
        compare_logits(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="3 targets for 2 rows"):
        compare_logits(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="no windows"):
        ComparisonAccumulator().result()


def _tiny_transformer(seed: int = 0):
    from churon.config import ModelConfig
    from churon.model.transformer import Transformer, expected_weight_shapes

    config = ModelConfig(
        architecture="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, context_length=64, rms_norm_eps=1e-6, rope_theta=10000.0,
    )
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        noise = torch.randn(shape, generator=g)
        weights[name] = 1.0 + 0.1 * noise if len(shape) == 1 else 0.2 * noise  # norms near 1
    return Transformer(config, weights)


def test_window_logits_match_token_by_token_decode_and_start_from_an_empty_cache():
    model = _tiny_transformer()
    window = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]
    logits = window_logits(model, window)
    assert logits.shape == (len(window), 50) and logits.dtype == torch.float32
    cache = SequenceKVCache.for_model(model, len(window))
    stepwise = torch.cat([model(torch.tensor([t]), i, cache) for i, t in enumerate(window)])
    assert torch.allclose(logits, stepwise, atol=1e-4, rtol=1e-4)
    assert torch.equal(window_logits(model, window), logits)  # no state carried between calls
    windows = text_windows(window * 2, ctx=8)
    assert compare(model, model, windows).mean_kl == 0
    assert perplexity(model, windows) == compare(model, _tiny_transformer(seed=1), windows).ppl_ref
