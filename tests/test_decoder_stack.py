"""The whole layer stack in one native call (churon._cpu.DecoderStack) against the per-op native path it replaces:
the same logits and the same K/V written, bit for bit, for every family it runs, in steps that mix prefill
chunks and decode tokens over several KV groups (windowed layers), on every ISA, KV dtype and thread count."""

import pytest
import torch

from churon import kernels
from churon.engine.kv_cache import PagedKVCache
from churon.loader import load_model
from churon.model.batch import ForwardBatch, SequenceChunk
from churon.model.kv_layout import KVLayout
from tiny_models import DECODER_ARCHS, make_hf_model, write_gguf

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason)

# MLPs with torch in them stay op by op: gpt-oss's routing and clamped experts, Qwen2-MoE's gated shared expert
OP_BY_OP = ("gpt_oss", "qwen2_moe")
BLOCK = 4


@pytest.fixture(scope="module", params=DECODER_ARCHS)
def hf_dir(request, tmp_path_factory):
    return make_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def load(hf_dir, qtype, tmp_path):
    if qtype == "hf":
        return load_model(hf_dir, kernels="native")[0]
    if hf_dir.name.startswith("mistral"):
        pytest.skip("convert_hf_to_gguf.py drops Mistral's sliding window (the GGUF is a llama)")
    return load_model(write_gguf(hf_dir, tmp_path / f"m-{qtype}.gguf", qtype), kernels="native")[0]


def steps(model, kv_dtype=torch.float32):
    """Three steps of two sequences on a fresh cache (zeroed, so that slots never written compare equal): a
    40-token prompt in chunks of 30 and 10 beside a 7-token prompt, then both decoding, then one token each again;
    the logits of every step and the cache after them. The prompts run past the tiny models' windows."""
    layout = KVLayout.of(model.config)
    groups = layout.num_groups
    cache = PagedKVCache(model.config, 32 * groups, BLOCK, dtype=kv_dtype, layout=layout)
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        if t is not None:
            t.zero_()

    def chunk(ids, start, first_block):
        tables = [list(range(first_block + 16 * g, first_block + 16 * (g + 1))) for g in range(groups)]
        return SequenceChunk(ids, start, tables[0], group_tables=tables[1:])

    a, b = list(range(5, 45)), list(range(100, 107))
    logits = []
    for chunks in ([chunk(a[:30], 0, 0), chunk(b, 0, 16 * groups)],
                   [chunk(a, 30, 0), chunk(b + [9], 7, 16 * groups)],
                   [chunk(a + [3], 40, 0), chunk(b + [9, 11], 8, 16 * groups)]):
        logits.append(model.forward_batch(ForwardBatch.build(chunks, BLOCK), cache))
    return logits, cache


def per_op(model, kv_dtype=torch.float32):
    stack, model.fused_stack = model.fused_stack, None
    try:
        return steps(model, kv_dtype)
    finally:
        model.fused_stack = stack


def assert_same(fused, op_by_op):
    (logits_f, cache_f), (logits_o, cache_o) = fused, op_by_op
    for step, (f, o) in enumerate(zip(logits_f, logits_o, strict=True)):
        assert torch.equal(f, o), f"step {step}: {int((f != o).sum())} logits differ"
    for name in ("k", "v", "k_scale", "v_scale"):
        f, o = getattr(cache_f, name), getattr(cache_o, name)
        assert (f is None and o is None) or torch.equal(f, o), f"the caches' {name} differ"


@pytest.mark.parametrize("qtype", ["hf", "Q4_0", "Q8_0"])
def test_the_stack_is_bitwise_the_per_op_path(hf_dir, qtype, tmp_path):
    model = load(hf_dir, qtype, tmp_path)
    if hf_dir.name.startswith(OP_BY_OP):
        assert model.fused_stack is None
        return
    assert model.fused_stack is not None
    assert_same(steps(model), per_op(model))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.int8])
def test_every_kv_dtype(tiny_llama_dir, kv_dtype):
    model = load_model(tiny_llama_dir, kernels="native")[0]
    assert_same(steps(model, kv_dtype), per_op(model, kv_dtype))


@pytest.mark.parametrize("n_threads", [1, 2])
def test_every_isa_and_thread_count(tiny_llama_q8, isa, threads, n_threads):
    threads(n_threads)
    model = load_model(tiny_llama_q8, kernels="native")[0]
    assert_same(steps(model), per_op(model))


def test_a_lora_batch_goes_op_by_op(tiny_llama_dir, tmp_path):
    """The stack has no adapters: a step with LoRA slots runs DecoderBlock's per-op path (its result is checked
    against PEFT in test_lora_model.py), one without on the stack, bitwise as before."""
    from churon.formats.lora import read_lora
    from tiny_models import make_peft_adapter

    model = load_model(tiny_llama_dir, kernels="native")[0]
    plain = steps(model)
    slots = model.enable_lora(1)
    slots.load(0, read_lora(make_peft_adapter(tiny_llama_dir, tmp_path / "adapter"), model.config))
    cache = PagedKVCache(model.config, 16, BLOCK)
    calls = []
    stack = model.fused_stack
    model.fused_stack = type("Spy", (), {"hidden_states": lambda self, *a: calls.append(a) or stack.hidden_states(*a)})()
    chunk = SequenceChunk(list(range(5, 15)), 0, [0, 1, 2], lora_slot=0)
    with_adapter = model.forward_batch(ForwardBatch.build([chunk], BLOCK), cache)
    assert calls == [] and with_adapter.isfinite().all()
    model.fused_stack = stack
    assert_same(steps(model), plain)


def test_a_bad_token_id_is_an_error_and_the_model_runs_on(tiny_llama_dir):
    model = load_model(tiny_llama_dir, kernels="native")[0]
    vocab = model.config.vocab_size
    cache = PagedKVCache(model.config, 16, BLOCK)
    with pytest.raises(IndexError, match=f"row id {vocab} is outside"):
        model.forward_batch(ForwardBatch.build([SequenceChunk([1, 2, vocab], 0, [0])], BLOCK), cache)
    assert_same(steps(model), per_op(model))
