import math

import pytest
import torch

from churon.sampling import Sampler, SamplingParams


def draw(params: SamplingParams, logits: list[float], prompt=(), n: int = 1) -> list[int]:
    sampler = Sampler(params, len(logits), prompt)
    return [sampler(torch.tensor(logits)) for _ in range(n)]


def test_temperature_zero_is_argmax():
    assert draw(SamplingParams(temperature=0), [0.1, 3.0, 2.9, -1.0]) == [1]


def test_greedy_takes_the_first_of_tied_maxima_and_ignores_padding_columns():
    assert draw(SamplingParams(temperature=0), [0.1, 3.0, -2.0, 3.0]) == [1]
    sampler = Sampler(SamplingParams(temperature=0), 3, ())
    assert sampler(torch.tensor([0.5, 2.0, 1.0, 9.0])) == 1  # column 3 is beyond the vocabulary
    assert sampler(torch.tensor([[0.0, 5.0], [1.0, 0.0], [4.0, 0.0], [9.0, 0.0]])[:, 0]) == 2  # a strided row


def test_logit_bias_changes_argmax():
    assert draw(SamplingParams(temperature=0, logit_bias={2: 0.2}), [0.1, 3.0, 2.9, -1.0]) == [2]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    # token 1 (seen) 3.0 / 2 = 1.5 < token 2's 2.0; token 0 (seen) -1 * 2 = -2
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    sampler = Sampler(params, 3, prompt_ids=[0, 1])
    assert sampler(torch.tensor([-1.0, 3.0, 2.0])) == 2


def test_presence_and_frequency_penalties_count_output_tokens_only():
    params = SamplingParams(temperature=0, frequency_penalty=0.5)
    sampler = Sampler(params, 3, prompt_ids=[0, 0, 0])
    logits = torch.tensor([1.0, 0.9, -5.0])
    assert sampler(logits) == 0  # the prompt does not count
    sampler.accept(0)
    assert sampler(logits) == 1  # 1.0 - 0.5 < 0.9
    params = SamplingParams(temperature=0, presence_penalty=0.2)
    sampler = Sampler(params, 3, prompt_ids=[])
    sampler.accept(0)
    assert sampler(logits) == 1


def test_top_k_one_is_greedy_even_at_high_temperature():
    assert set(draw(SamplingParams(temperature=5.0, top_k=1, seed=0), [0.0, 1.0, 0.5, 0.2], n=50)) == {1}


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().tolist()
    # 0.5 < 0.7 so the second token stays; 0.8 >= 0.7 so the third goes
    got = set(draw(SamplingParams(temperature=1.0, top_p=0.7, seed=1), logits, n=400))
    assert got == {0, 1}


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("spread", [0.5, 3.0])  # flat and peaked distributions over a 49152-token vocabulary
def test_top_p_set_equals_a_full_sort(top_p, spread):
    from churon.sampling import _outside_top_p

    logits = torch.randn(49152, generator=torch.Generator().manual_seed(7)) * spread
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits.double(), dim=-1)
    before = torch.empty(49152, dtype=torch.float64)
    before[order] = probs.cumsum(-1) - probs  # the probability of the tokens more likely than each
    want = before >= top_p
    want[order[0]] = False
    got = _outside_top_p(logits, top_p)
    kept = int((~got).sum())
    # float32 against float64 sums may disagree only on tokens right at the edge
    assert ((before[got != want] - top_p).abs() < 1e-5).all() and kept >= 1
    assert kept == 1 or kept > 64 or top_p < 0.9  # the flat cases need more than the first 64 candidates


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    got = set(draw(SamplingParams(temperature=1.0, min_p=0.5, seed=2), probs.log().tolist(), n=400))
    assert got == {0, 1}  # 0.15 < 0.5 * 0.5


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    draws = draw(SamplingParams(temperature=1.0, seed=3), probs.log().tolist(), n=3000)
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.04)


def test_same_seed_same_draws_and_other_seed_differs():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0)).tolist()
    a = draw(SamplingParams(temperature=1.0, seed=42), logits, n=30)
    b = draw(SamplingParams(temperature=1.0, seed=42), logits, n=30)
    c = draw(SamplingParams(temperature=1.0, seed=43), logits, n=30)
    assert a == b
    assert a != c


def test_temperature_sharpens():
    logits = [2.0, 1.0, 0.0]
    cold = draw(SamplingParams(temperature=0.2, seed=0), logits, n=500)
    hot = draw(SamplingParams(temperature=2.0, seed=0), logits, n=500)
    assert cold.count(0) > hot.count(0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {1: math.inf}}, "logit_bias"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": "5"}, "prompt_logprobs"),
        ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"json_schema": "{}"}, "json_schema"),
    ],
)
def test_invalid_parameters_name_the_field_and_value(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_out_of_vocabulary_token_ids_in_params_are_rejected():
    with pytest.raises(ValueError, match="token id 7"):
        Sampler(SamplingParams(logit_bias={7: 1.0}), 5, [])


def test_from_fields_reads_the_shared_fields_and_takes_the_callers_over_them():
    from types import SimpleNamespace

    source = SimpleNamespace(max_tokens=9, temperature=0.5, top_k=7, top_p=0.8, min_p=0.1, repetition_penalty=1.2,
                             seed=3, stop="END", presence_penalty=1.5)  # not a shared field: left alone
    p = SamplingParams.from_fields(source, seed=4, logprobs=2)
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (9, 0.5, 7, 0.8, 0.1, 1.2)
    assert p.seed == 4 and p.logprobs == 2 and p.stop == ["END"] and p.presence_penalty == 0.0
    with pytest.raises(AttributeError, match="min_p"):
        SamplingParams.from_fields(SimpleNamespace(**{k: v for k, v in vars(source).items() if k != "min_p"}))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_fields(source, temperature=-1.0)
