"""The serving engine on a tiny model: continuous batching, prefix caching, chunked prefill,
preemption and abort, and outputs that do not depend on the batch."""

import random

import pytest
import torch

from churon import SamplingParams
from churon.config import EngineConfig
from churon.engine import LLMEngine
from churon.errors import ContextLengthError
from churon.loader import load_model
from churon.engine.kv_cache import kv_bytes_per_token
from churon.engine.memory import MemoryPlanError, plan_memory, what_fits
from tiny_models import make_hf_model, write_gguf


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    hf = make_hf_model("llama", tmp_path_factory.mktemp("llama"))
    path = write_gguf(hf, tmp_path_factory.mktemp("gguf") / "m.gguf", "Q8_0")
    model, tokenizer, _ = load_model(path)
    return model, tokenizer


def engine(model_and_tokenizer, **options) -> LLMEngine:
    model, tokenizer = model_and_tokenizer
    options.setdefault("kv_cache_memory", 4 << 20)
    return LLMEngine(model, tokenizer, EngineConfig(**options))


def prompts(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 400) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 400) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def sampled(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=24, ignore_eos=True)


def alone(model_and_tokenizer, ps, params, **options) -> list[list[int]]:
    """Each request in an engine of its own: the reference every batched run must equal bit for bit."""
    return [engine(model_and_tokenizer, **options).generate([p], [sp])[0].token_ids for p, sp in zip(ps, params)]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"enable_prefix_caching": False},
        {"enable_chunked_prefill": False},
        {"max_num_batched_tokens": 7},  # prompts run in many small chunks beside decodes
        {"max_num_seqs": 3},
        {"block_size": 4, "kv_cache_memory": 64 * 1024},  # a tiny pool: constant preemption
        {"kv_dtype": "bfloat16"},
        {"kv_dtype": "float16", "max_num_batched_tokens": 7},
        {"kv_dtype": "int8", "max_num_batched_tokens": 7},
        {"kv_dtype": "int8", "block_size": 4, "kv_cache_memory": 16 * 1024},
    ],
    ids=["default", "no-prefix-cache", "no-chunked-prefill", "small-chunks", "few-seqs", "preemption", "bf16-kv", "f16-kv",
         "int8-kv", "int8-kv-preemption"],
)
def test_outputs_do_not_depend_on_the_batch(model_and_tokenizer, options, tiles_on_off):
    ps = prompts(16, seed=1, shared_prefix=20)
    params = [GREEDY if i % 2 else sampled(i) for i in range(len(ps))]
    kv = {"kv_dtype": options["kv_dtype"]} if "kv_dtype" in options else {}
    expected = alone(model_and_tokenizer, ps, params, **kv)
    eng = engine(model_and_tokenizer, **options)
    got = [o.token_ids for o in eng.generate(ps, params)]
    assert got == expected
    if "kv_cache_memory" in options:
        assert eng.scheduler.num_preemptions > 0


def test_32_requests_under_a_tiny_kv_budget_all_finish_like_the_unconstrained_run(model_and_tokenizer):
    ps = prompts(32, seed=2, shared_prefix=8)
    big = engine(model_and_tokenizer).generate(ps, GREEDY)
    small_engine = engine(model_and_tokenizer, block_size=4, kv_cache_memory=64 * 1024)
    small = small_engine.generate(ps, GREEDY)
    assert small_engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in small] == [o.token_ids for o in big]
    assert all(o.finish_reason == "length" for o in small)


def test_prefix_cache_hits_and_identical_outputs(model_and_tokenizer):
    ps = prompts(6, seed=3, shared_prefix=48)
    eng = engine(model_and_tokenizer)
    first = eng.generate(ps[:1], GREEDY)
    rest = eng.generate(ps[1:], GREEDY)
    bm = eng.block_manager
    assert bm.num_hit_blocks >= 5 * (48 // 16)  # every later request reuses the shared 48-token prefix
    assert [o.metrics.cached_prompt_tokens for o in rest] == [48] * 5
    uncached = engine(model_and_tokenizer, enable_prefix_caching=False).generate(ps, GREEDY)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in uncached]


def test_abort_frees_blocks_at_once(model_and_tokenizer):
    eng = engine(model_and_tokenizer)
    keep = eng.add_request(prompts(1, seed=4)[0], GREEDY)
    drop = eng.add_request([5] * 40, SamplingParams(max_tokens=200, ignore_eos=True))
    eng.step()
    eng.step()
    used = eng.block_manager.num_used_blocks
    assert eng.abort(drop)
    assert eng.block_manager.num_used_blocks < used
    assert not eng.abort(drop)  # already gone
    outputs = []
    while eng.has_unfinished():
        outputs += [d for d in eng.step() if d.output.finish_reason]
    assert [d.request_id for d in outputs] == [keep]
    assert eng.block_manager.num_used_blocks == 0


def test_stream_stopped_early_frees_its_blocks(model_and_tokenizer):
    eng = engine(model_and_tokenizer)
    for i, _ in enumerate(eng.stream([7] * 30, SamplingParams(max_tokens=100, ignore_eos=True))):
        if i == 3:
            break
    assert eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished()


def test_a_request_that_can_never_fit_is_a_clear_error(model_and_tokenizer):
    eng = engine(model_and_tokenizer, block_size=4, kv_cache_memory=16 * 1024)
    capacity = eng.memory_plan.kv_tokens
    with pytest.raises(ContextLengthError, match=f"whole cache holds {capacity} tokens"):
        eng.add_request([5] * 10, SamplingParams(max_tokens=capacity, ignore_eos=True))
    assert not eng.has_unfinished()


def test_a_bad_prompt_in_a_batch_leaves_nothing_queued(model_and_tokenizer):
    eng = engine(model_and_tokenizer)
    with pytest.raises(ContextLengthError):
        eng.generate([[5, 6], [5] * 1000], GREEDY)
    assert not eng.has_unfinished()


def test_memory_planner_says_what_fits(model_and_tokenizer):
    model, _ = model_and_tokenizer
    config = model.config
    per_token = kv_bytes_per_token(config, torch.float32)
    assert per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    # int8: a byte per value plus a float32 scale per (token, kv head)
    assert kv_bytes_per_token(config, torch.int8) == 2 * config.num_layers * config.num_kv_heads * (config.head_dim + 4)
    engine_config = EngineConfig(kv_cache_memory=10**12)
    with pytest.raises(MemoryPlanError, match="does not fit.*fits"):
        plan_memory(config, 10**6, engine_config, 256, torch.float32, available=10**9)
    plan = plan_memory(config, 10**6, EngineConfig(kv_cache_memory=per_token * 512), 256, torch.float32, available=10**9)
    assert plan.kv_tokens == 512
    assert what_fits(6 * 8192 + 5, 8192) == "fits 2k context for 24 sequences, or 8k context for 6 sequences"
    assert what_fits(40000, 32768) == "fits 2k context for 19 sequences, or 8k context for 4 sequences, or 32k context for 1 sequence"
    with pytest.raises(MemoryPlanError, match="does not fit"):
        plan_memory(config, 10**10, EngineConfig(), 256, torch.float32, available=10**9)


def test_one_row_greedy_steps_read_the_coarse_copy(tmp_path, monkeypatch):
    # a generation engine asks its model for a coarse copy of a large Q8_0 output matrix (NativeBackend.prepare_argmax)
    # before planning memory, which counts it; a greedy request decoding alone reads it, and its tokens are those
    # without it (a tiny model here, the size threshold lowered to 0)
    from churon.model import native_backend

    path = write_gguf(make_hf_model("llama", tmp_path / "hf"), tmp_path / "m.gguf", "Q8_0")
    ps = prompts(4, seed=9)
    plain, tokenizer, _ = load_model(path)
    want = [LLMEngine(plain, tokenizer, EngineConfig(kv_cache_memory=4 << 20)).generate([p], GREEDY)[0] for p in ps]
    assert "coarse" not in getattr(plain.lm_head, "layout", "")  # below the threshold: none
    monkeypatch.setattr(native_backend, "COARSE_ARGMAX_BYTES", 0)
    coarse, _, _ = load_model(path)
    assert "coarse" not in getattr(coarse.lm_head, "layout", "")  # loading alone builds none (an embedder's load)
    engine = LLMEngine(coarse, tokenizer, EngineConfig(kv_cache_memory=4 << 20))
    if "coarse" not in getattr(coarse.lm_head, "layout", ""):
        pytest.skip("no coarse argmax kernel here (native backend with AVX-512)")
    assert coarse.weight_bytes() > plain.weight_bytes()
    assert engine.memory_plan.weight_bytes == coarse.weight_bytes()
    for p, w in zip(ps, want):
        got = LLMEngine(coarse, tokenizer, EngineConfig(kv_cache_memory=4 << 20)).generate([p], GREEDY)[0]
        assert got.token_ids == w.token_ids


def test_logits_rows_read_for_their_argmax_alone(model_and_tokenizer, monkeypatch):
    # a step whose every sampled row is greedy with nothing else read of it (no penalty, bias, grammar, logprobs) asks
    # the model for argmax-only logits (matmul_argmax: the lo product only where the maximum may be); any other request
    # in the step gets the whole precise rows. The tokens are the same either way (test_kernels: matmul_argmax).
    model, _ = model_and_tokenizer
    flags = []
    forward = type(model).forward_batch

    def recording(self, batch, cache, argmax_only=False):
        flags.append(argmax_only)
        return forward(self, batch, cache, argmax_only)

    monkeypatch.setattr(type(model), "forward_batch", recording)
    ps = prompts(3, seed=5)
    cases = {
        "greedy": (GREEDY, True),
        "logprobs": (SamplingParams(temperature=0, max_tokens=6, logprobs=2), False),
        "penalty": (SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3), False),
        "bias": (SamplingParams(temperature=0, max_tokens=6, logit_bias={5: 2.0}), False),
        "sampled": (sampled(0), False),
        "grammar": (SamplingParams(temperature=0, max_tokens=6, json_schema={"type": "object"}), False),
    }
    for name, (params, expected) in cases.items():
        flags.clear()
        engine(model_and_tokenizer).generate(ps, params)
        assert flags and set(flags) == {expected}, name
    # a greedy request beside a sampled one: the step is not argmax-only, and the greedy tokens are those alone
    flags.clear()
    mixed = engine(model_and_tokenizer).generate(ps[:2], [GREEDY, sampled(1)])
    assert not any(flags)
    assert mixed[0].token_ids == alone(model_and_tokenizer, ps[:1], [GREEDY])[0]
