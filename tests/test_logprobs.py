"""Log-probabilities of generated and prompt tokens, against a forward pass over the whole sequence."""

import random

import pytest
import torch

from churon import SamplingParams
from churon.config import EngineConfig
from churon.engine import core as engine_module
from churon.engine import LLMEngine
from churon.loader import load_model
from churon.engine.kv_cache import SequenceKVCache
from tiny_models import make_hf_model, write_gguf

# the reference kernels compute a row the same way whatever else runs beside it; the native ones
# may differ from a one-shot forward pass in the last float bits
TOLERANCE = {"reference": 1e-4, "native": 1e-3}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    hf = make_hf_model("llama", tmp_path_factory.mktemp("llama"))
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / "m.gguf", "Q8_0")


@pytest.fixture(scope="module", params=["reference", "native"])
def model_and_tokenizer(request, gguf_path):
    model, tokenizer, _ = load_model(gguf_path, kernels=request.param)
    if model.backend.name != request.param:
        pytest.skip(f"{request.param} kernels are not built")
    return model, tokenizer


def engine(model_and_tokenizer, **options) -> LLMEngine:
    model, tokenizer = model_and_tokenizer
    options.setdefault("kv_cache_memory", 4 << 20)
    return LLMEngine(model, tokenizer, EngineConfig(**options))


def full_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position, from one forward pass over the whole sequence."""
    logits = model(torch.tensor(tokens), 0, SequenceKVCache.for_model(model, len(tokens)), all_logits=True)
    return torch.log_softmax(logits[:, : model.config.vocab_size].float(), dim=-1)


def check_entry(entry, expected_row: torch.Tensor, token: int, k: int, tol: float) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(expected_row[token].item(), abs=tol)
    assert len(entry.top) == k
    ids = [t for t, _ in entry.top]
    values = [v for _, v in entry.top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(expected_row.topk(k).values.tolist(), abs=tol)
    assert values == pytest.approx(expected_row[ids].tolist(), abs=tol)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(20, 45))] for _ in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generated_token_logprobs_are_those_of_the_full_sequence(model_and_tokenizer, temperature):
    model, _ = model_and_tokenizer
    tol = TOLERANCE[model.backend.name]
    ps = prompts(3, seed=1)
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=8, ignore_eos=True, logprobs=5, repetition_penalty=1.3)
        for i in range(len(ps))
    ]
    for prompt, out in zip(ps, engine(model_and_tokenizer).generate(ps, params)):
        assert len(out.logprobs) == len(out.token_ids) == 8
        expected = full_logprobs(model, prompt + out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            check_entry(entry, expected[len(prompt) - 1 + i], token, 5, tol)
    # raw logprobs: before the repetition penalty, which can move the greedy pick off the model's top token
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    out = engine(model_and_tokenizer).generate(ps[:1], greedy)[0]
    assert [e.top[0][0] for e in out.logprobs] == out.token_ids


def test_stream_deltas_carry_the_same_logprobs(model_and_tokenizer):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=2)
    prompt = prompts(1, seed=2)[0]
    deltas = list(engine(model_and_tokenizer).stream(prompt, params))
    final = deltas[-1].output
    assert [d.logprob for d in deltas] == final.logprobs
    assert [d.token_id for d in deltas] == final.token_ids


def test_logprobs_zero_and_the_ending_tokens_entry(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    eos = sorted(tokenizer.eog_ids)[0]
    eng = engine(model_and_tokenizer)
    out = eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))[0]
    assert len(out.logprobs) == 4 and all(e.top == [] for e in out.logprobs)
    # end-of-generation right away: the stop token is the output's one token, with its logprob (vLLM's rule), and no text
    deltas = list(eng.stream([5, 6, 7], SamplingParams(temperature=0, logit_bias={eos: 1000.0}, logprobs=3)))
    last = deltas[-1]
    assert last.output.token_ids == [eos] and last.output.logprobs == [last.logprob] and last.output.text == ""
    assert last.token_id == eos and last.logprob.token_id == eos and len(last.logprob.top) == 3
    plain = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None


@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 7}, {"block_size": 4, "kv_cache_memory": 32 * 1024, "max_num_batched_tokens": 13}],
    ids=["whole-prompt", "chunked-prefill", "preemption"],
)
def test_prompt_logprobs_are_those_of_the_full_prompt(model_and_tokenizer, options):
    model, _ = model_and_tokenizer
    tol = TOLERANCE[model.backend.name]
    ps = prompts(6, seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=3 if i % 2 else None) for i in range(6)
    ]
    eng = engine(model_and_tokenizer, **options)
    outs = eng.generate(ps, params)
    if "kv_cache_memory" in options:
        assert eng.scheduler.num_preemptions > 0
    for prompt, sp, out in zip(ps, params, outs):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        expected = full_logprobs(model, prompt)
        for i in range(1, len(prompt)):
            check_entry(out.prompt_logprobs[i], expected[i - 1], prompt[i], 3, tol)
    # asking for prompt logprobs changes nothing else
    plain = engine(model_and_tokenizer).generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_prompt_logprobs_with_a_cached_prefix(model_and_tokenizer):
    model, _ = model_and_tokenizer
    tol = TOLERANCE[model.backend.name]
    prompt = prompts(1, seed=4)[0] * 2  # 40+ tokens: at least two full 16-token blocks
    eng = engine(model_and_tokenizer, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.generate([prompt], params)
    again = eng.generate([prompt], params)[0]
    assert again.metrics.cached_prompt_tokens >= 32  # the prompt is in the cache
    with_logprobs = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))[0]
    assert with_logprobs.metrics.cached_prompt_tokens == 0  # recomputed: cached positions have no logits
    assert with_logprobs.token_ids == again.token_ids
    expected = full_logprobs(model, prompt)
    for i in range(1, len(prompt)):
        check_entry(with_logprobs.prompt_logprobs[i], expected[i - 1], prompt[i], 1, tol)


def test_prompt_logits_rows_per_step_are_bounded(model_and_tokenizer, monkeypatch):
    """Requests asking for prompt logprobs run at most max_prompt_logits_rows prompt tokens per step, all
    together (each row is vocabulary-wide); their logprobs and every request's tokens stay the same."""
    model, _ = model_and_tokenizer
    ps = prompts(6, seed=4)
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2 if i % 2 else None) for i in range(6)
    ]

    def run(logits_rows: int | None):
        if logits_rows is not None:
            monkeypatch.setattr(engine_module, "PROMPT_LOGITS_BYTES", logits_rows * 4 * model.config.vocab_size)
        eng = engine(model_and_tokenizer)
        rows: list[int] = []  # per step: the tokens of chunks that return every row
        execute = eng.runner.execute

        def counting(scheduled, all_rows, argmax_only=False):
            rows.append(sum(s.num_tokens for s, every in zip(scheduled, all_rows) if every))
            return execute(scheduled, all_rows, argmax_only)

        eng.runner.execute = counting
        return eng, eng.generate(ps, params), rows

    _, free, free_rows = run(None)
    bounded_engine, bounded, bounded_rows = run(5)
    assert bounded_engine.scheduler.max_prompt_logits_rows == 5
    assert max(bounded_rows) <= 5 < max(free_rows)
    assert [o.token_ids for o in bounded] == [o.token_ids for o in free]
    if model.backend.name == "native":  # batch-invariant: the same bits whatever the chunks
        assert [o.prompt_logprobs for o in bounded] == [o.prompt_logprobs for o in free]
    for a, b in zip(bounded, free):  # the reference's float32 GEMM rounds by chunk size
        assert len(a.prompt_logprobs or []) == len(b.prompt_logprobs or [])
        for x, y in zip((a.prompt_logprobs or [])[1:], (b.prompt_logprobs or [])[1:]):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=TOLERANCE["reference"])
