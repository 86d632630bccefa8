"""LoRA adapters on the model (churon.model.lora, the backends' add_lora): churon's logits under random PEFT
adapters equal PEFT's on tiny Llama, Qwen2 and Qwen3 models, from the Hugging Face directory and from the
GGUF; a batch mixing adapters and none gives each sequence what it gets alone (bitwise on the native path);
a batch without adapters runs exactly the base model."""

import gc
import weakref
from dataclasses import replace

import pytest
import torch

from churon import kernels
from churon.engine.kv_cache import PagedKVCache, SequenceKVCache
from churon.errors import ModelFileError
from churon.formats.lora import LoraModule, read_lora, write_lora_gguf
from churon.loader import load_model
from churon.model.batch import ForwardBatch, SequenceChunk
from test_model_reference import RTOL, assert_close_relative
from tiny_models import ARCHS, make_hf_model, make_peft_adapter, peft_model, reference_model, write_gguf

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 8, 19, 23, 77, 150, 201, 33, 2, 90]
DECODE = [9, 99, 199]
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
VARIANTS = {
    "rank1": dict(rank=1, alpha=2.0),
    "rank4": dict(rank=4),
    "rank8-rslora": dict(rank=8, alpha=16.0, use_rslora=True),
    "qkvo-only": dict(targets=ATTENTION),
    "gate-up-down-only": dict(targets=MLP),
    # the usual PEFT default targets, k left out of the fused qkv; ranks and alphas differing by module
    "q-v-patterns": dict(targets=("q_proj", "v_proj"), rank_pattern={"v_proj": 6}, alpha_pattern={"q_proj": 3.0}),
}
native_only = pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason)


@pytest.fixture(scope="module", params=ARCHS)
def hf_dir(request, tmp_path_factory):
    return make_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def adapter_dir(hf_dir, tmp_path, name="adapter", **kwargs):
    return make_peft_adapter(hf_dir, tmp_path / name, **kwargs)


@pytest.fixture(scope="module")
def variant_adapter(hf_dir, tmp_path_factory):
    """The adapter directory of a VARIANTS entry for hf_dir's model, made once per module."""
    made = {}

    def get(variant):
        if variant not in made:
            made[variant] = adapter_dir(hf_dir, tmp_path_factory.mktemp(variant), **VARIANTS[variant])
        return made[variant]

    return get


def with_adapters(path, adapters, kernels_="reference", max_loras=8):
    """The model at path with each adapter directory in adapters loaded into slots 0, 1, ..."""
    model, _, _ = load_model(path, kernels=kernels_)
    slots = model.enable_lora(max_loras)
    for slot, a in enumerate(adapters):
        slots.load(slot, read_lora(a, model.config))
    return model


def compare_with_reference(model, reference, rtol=RTOL, lora_slot=0, lora_scale=1.0) -> None:
    """The prompt's logits at every position, then a few decode steps through churon's KV cache."""
    cache = SequenceKVCache(model.config, len(PROMPT) + len(DECODE), dtype=torch.float32)
    tokens = list(PROMPT)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    actual = model(torch.tensor(tokens), 0, cache, all_logits=True, lora_slot=lora_slot, lora_scale=lora_scale)
    assert_close_relative(actual, expected, rtol)
    for token in DECODE:
        tokens.append(token)
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1]
        actual = model(torch.tensor([token]), len(tokens) - 1, cache, lora_slot=lora_slot, lora_scale=lora_scale)
        assert_close_relative(actual[0], expected, rtol)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_under_an_adapter_match_peft(hf_dir, variant, variant_adapter):
    adapter = variant_adapter(variant)
    compare_with_reference(with_adapters(hf_dir, [adapter]), peft_model(hf_dir, adapter))


@pytest.mark.parametrize("variant", ["rank8-rslora", "q-v-patterns"])
def test_gguf_model_under_an_adapter_matches_peft(hf_dir, variant, variant_adapter, tmp_path):
    adapter = variant_adapter(variant)
    gguf = write_gguf(hf_dir, tmp_path / "m.gguf", "F32")
    compare_with_reference(with_adapters(gguf, [adapter]), peft_model(hf_dir, adapter, gguf))


def test_an_adapter_converted_to_gguf_gives_peft_s_logits(hf_dir, variant_adapter, tmp_path):
    """The adapter as a llama.cpp GGUF adapter (llama's q/k rows permuted in the file), on the GGUF model."""
    adapter = variant_adapter("q-v-patterns")
    gguf = write_gguf(hf_dir, tmp_path / "m.gguf", "F32")
    model, _, _ = load_model(gguf, kernels="reference")
    gguf_adapter = write_lora_gguf(read_lora(adapter, model.config), model.config, tmp_path / "adapter.gguf")
    model.enable_lora(2).load(1, read_lora(gguf_adapter, model.config))
    compare_with_reference(model, peft_model(hf_dir, adapter, gguf), lora_slot=1)


def test_the_adapter_really_changes_the_logits(hf_dir, variant_adapter):
    """Guards the tests above: PEFT with the adapter must not be (nearly) the base model."""
    adapter = variant_adapter("rank4")
    model = with_adapters(hf_dir, [adapter])
    cache = SequenceKVCache.for_model(model, len(PROMPT))
    base = model(torch.tensor(PROMPT), 0, cache, all_logits=True)
    with torch.no_grad():
        expected = peft_model(hf_dir, adapter)(torch.tensor([PROMPT])).logits[0]
    assert (base - expected).abs().max() > 0.05 * expected.abs().max()


def test_lora_scale_scales_the_adapters_delta(hf_dir, variant_adapter):
    """lora_scale 0.5 is PEFT with every module's scaling halved."""
    adapter = variant_adapter("rank4")
    reference = peft_model(hf_dir, adapter)
    for module in reference.modules():
        if isinstance(getattr(module, "scaling", None), dict):
            module.scaling = {name: s * 0.5 for name, s in module.scaling.items()}
    compare_with_reference(with_adapters(hf_dir, [adapter]), reference, lora_scale=0.5)


def test_hidden_states_under_an_adapter_match_peft(hf_dir, variant_adapter):
    """The decoder-embedder path (Transformer.hidden_states) applies the adapter too."""
    adapter = variant_adapter("rank4")
    model = with_adapters(hf_dir, [adapter])
    cache = SequenceKVCache.for_model(model, len(PROMPT))
    chunk = SequenceChunk(PROMPT, 0, cache.block_table, all_logits=True, lora_slot=0)
    actual = model.hidden_states(ForwardBatch.build([chunk], cache.block_size), cache)
    with torch.no_grad():
        expected = peft_model(hf_dir, adapter).base_model.model.model(torch.tensor([PROMPT])).last_hidden_state[0]
    assert_close_relative(actual, expected)


# four adapters of different ranks and targets, and a sequence under none (slot -1) among them
MIXED = [dict(rank=1, targets=ATTENTION, seed=1), dict(rank=4, seed=2), dict(rank=8, use_rslora=True, targets=MLP, seed=3),
         dict(rank=2, targets=("q_proj", "v_proj"), seed=4)]
MIXED_SLOTS = [0, 1, -1, 2, 3]
MIXED_PROMPTS = [PROMPT, PROMPT[:13], PROMPT[3:], [7] * 9, PROMPT[::-1]]


def run_mixed(model):
    """Each sequence's prefill logits (every position) and one decode step's, all five batched in each
    step, and each alone; returns (batched, alone), each a list of [tokens + 1, vocab] per sequence."""
    cache = PagedKVCache(model.config, num_blocks=64, block_size=4)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(MIXED_SLOTS))]

    def chunks(indices, step):
        out = []
        for i in indices:
            prompt = MIXED_PROMPTS[i]
            tokens, start = (prompt, 0) if step == 0 else (prompt + [DECODE[0]], len(prompt))
            out.append(SequenceChunk(tokens, start, tables[i], all_logits=True, lora_slot=MIXED_SLOTS[i]))
        return out

    def run(indices):
        rows = [[] for _ in indices]
        for step in (0, 1):
            batch_chunks = chunks(indices, step)
            logits = model.forward_batch(ForwardBatch.build(batch_chunks, cache.block_size), cache)
            sizes = [len(c.token_ids) - c.start for c in batch_chunks]
            for k, part in enumerate(logits.split(sizes)):
                rows[k].append(part)
        return [torch.cat(r) for r in rows]

    batched = run(range(len(MIXED_SLOTS)))
    alone = [run([i])[0] for i in range(len(MIXED_SLOTS))]
    return batched, alone


def mixed_references(hf_dir, adapters, gguf=None):
    """PEFT's (or, for slot -1, transformers') logits of each mixed sequence: its prompt, then DECODE[0]."""
    out = []
    for i, slot in enumerate(MIXED_SLOTS):
        reference = reference_model(hf_dir, gguf) if slot < 0 else peft_model(hf_dir, adapters[slot], gguf)
        with torch.no_grad():
            out.append(reference(torch.tensor([MIXED_PROMPTS[i] + [DECODE[0]]])).logits[0])
    return out


@pytest.fixture(scope="module")
def mixed_adapters(hf_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    return [make_peft_adapter(hf_dir, d / f"a{i}", **kw) for i, kw in enumerate(MIXED)]


def test_a_batch_mixing_four_adapters_and_none_gives_each_sequence_its_own(hf_dir, mixed_adapters):
    model = with_adapters(hf_dir, mixed_adapters)
    batched, alone = run_mixed(model)
    for got, single, expected in zip(batched, alone, mixed_references(hf_dir, mixed_adapters)):
        assert_close_relative(got, single, 1e-5)
        assert_close_relative(got, expected)


def test_without_adapter_slots_the_batch_runs_exactly_the_base_model(hf_dir, mixed_adapters):
    model = with_adapters(hf_dir, mixed_adapters)
    base, _, _ = load_model(hf_dir, kernels="reference")
    chunk = SequenceChunk(PROMPT, 0, list(range(8)), all_logits=True)
    batch = ForwardBatch.build([chunk], 4)
    assert batch.lora_slots is None and batch.lora_scales is None
    cache = PagedKVCache(model.config, num_blocks=8, block_size=4)
    assert torch.equal(model.forward_batch(batch, cache), base.forward_batch(batch, cache))


def test_the_batch_carries_each_tokens_slot_and_scale():
    chunks = [SequenceChunk([1, 2, 3], 1, [0], lora_slot=2, lora_scale=0.5), SequenceChunk([4], 0, [1]),
              SequenceChunk([5, 6, 7], 0, [2], lora_slot=0)]
    batch = ForwardBatch.build(chunks, 4)
    assert batch.lora_slots.dtype == torch.int32 and batch.lora_scales.dtype == torch.float32
    assert batch.lora_slots.tolist() == [2, 2, -1, 0, 0, 0]
    assert batch.lora_scales.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="chunk 0: LoRA slot -2"):
        ForwardBatch.build([SequenceChunk([1], 0, [0], lora_slot=-2)], 4)


# --- LoraSlots: loading, unloading, what it refuses ---

@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("llama"))


def test_slots_refuse_a_slot_out_of_range_or_taken_and_an_empty_unload(llama_dir, tmp_path):
    model, _, _ = load_model(llama_dir, kernels="reference")
    slots = model.enable_lora(2)
    adapter = read_lora(adapter_dir(llama_dir, tmp_path), model.config)
    for slot in (-1, 2):
        with pytest.raises(ValueError, match=f"LoRA slot {slot} is out of range: this model has slots 0..1"):
            slots.load(slot, adapter)
    slots.load(1, adapter)
    with pytest.raises(ValueError, match="LoRA slot 1 already holds the adapter"):
        slots.load(1, adapter)
    with pytest.raises(ValueError, match="LoRA slot 0 holds no adapter"):
        slots.unload(0)
    with pytest.raises(ValueError, match="already enabled"):
        model.enable_lora(4)
    cache = SequenceKVCache.for_model(model, 8)
    with pytest.raises(ValueError, match="LoRA slot 2 is out of range"):
        model(torch.tensor([1, 2]), 0, cache, lora_slot=2)
    plain, _, _ = load_model(llama_dir, kernels="reference")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain(torch.tensor([1, 2]), 0, SequenceKVCache.for_model(plain, 8), lora_slot=0)


def test_an_adapter_that_does_not_fit_is_refused_and_leaves_its_slot_free(llama_dir, tmp_path):
    model, _, _ = load_model(llama_dir, kernels="reference")
    slots = model.enable_lora(2)
    adapter = read_lora(adapter_dir(llama_dir, tmp_path), model.config)
    name = "layers.1.mlp.down_proj"
    m = adapter.modules[name]
    bad = replace(adapter, modules=adapter.modules | {name: LoraModule(m.a[:, :-1], m.b, m.scale)})
    with pytest.raises(ModelFileError, match="down_proj"):
        slots.load(0, bad)
    assert slots.adapters == [None, None] and slots.nbytes == 0
    slots.load(0, adapter)  # the slot is still free


def test_loading_and_unloading_rebuild_only_the_stacks_they_touch(llama_dir, tmp_path):
    model, _, _ = load_model(llama_dir, kernels="reference")
    slots = model.enable_lora(4)
    attention = read_lora(adapter_dir(llama_dir, tmp_path, "attn", targets=ATTENTION), model.config)
    mlp = read_lora(adapter_dir(llama_dir, tmp_path, "mlp", targets=MLP, rank=2), model.config)
    layers = range(model.config.num_layers)
    slots.load(0, attention)
    qkv_o = [(slots.stack(i, "qkv"), slots.stack(i, "o")) for i in layers]
    assert all(q is not None and o is not None for q, o in qkv_o)
    assert all(slots.stack(i, "gate_up") is None and slots.stack(i, "down") is None for i in layers)
    slots.load(3, mlp)
    assert all(slots.stack(i, "qkv") is q and slots.stack(i, "o") is o for i, (q, o) in zip(layers, qkv_o))
    mlp_stacks = [(slots.stack(i, "gate_up"), slots.stack(i, "down")) for i in layers]
    assert all(g is not None and d is not None for g, d in mlp_stacks)
    assert slots.nbytes == fused_bytes(attention, model.config) + fused_bytes(mlp, model.config)
    slots.unload(0)
    assert all(slots.stack(i, "qkv") is None and slots.stack(i, "o") is None for i in layers)
    assert all(slots.stack(i, "gate_up") is g and slots.stack(i, "down") is d for i, (g, d) in zip(layers, mlp_stacks))
    assert slots.nbytes == fused_bytes(mlp, model.config)
    slots.unload(3)
    assert slots.nbytes == 0 and all(layer == {} for layer in slots.layers)


@native_only
def test_the_slots_hold_no_second_copy_of_the_fused_pairs(llama_dir, tmp_path, monkeypatch):
    """The native stack keeps B transposed: the fused B it was built from (mostly zeros for qkv) must be freed,
    not kept beside it (a rank-64 adapter's fused B is tens of MB per slot on a real model)."""
    model, _, _ = load_model(llama_dir, kernels="native")
    slots = model.enable_lora(2)
    fused_b = []
    build = model.backend.lora_stack

    def recording_stack(pairs):
        fused_b.extend(weakref.ref(p[1]) for p in pairs if p is not None)
        return build(pairs)

    monkeypatch.setattr(model.backend, "lora_stack", recording_stack)
    adapter = read_lora(adapter_dir(llama_dir, tmp_path, "all"), model.config)
    slots.load(0, adapter)
    slots.load(1, read_lora(adapter_dir(llama_dir, tmp_path, "mlp", targets=MLP, rank=2), model.config))
    gc.collect()
    assert fused_b and all(ref() is None for ref in fused_b)
    assert slots.nbytes == fused_bytes(adapter, model.config) + fused_bytes(slots.adapters[1], model.config)


def fused_bytes(adapter, config) -> int:
    """float32 bytes of the adapter's fused pairs: per fused matrix, A [sum r, in] and B [out, sum r]."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    fused = {"qkv": (("q_proj", "k_proj", "v_proj"), q + 2 * kv, config.hidden_size),
             "o": (("o_proj",), config.hidden_size, q),
             "gate_up": (("gate_proj", "up_proj"), 2 * config.intermediate_size, config.hidden_size),
             "down": (("down_proj",), config.hidden_size, config.intermediate_size)}
    total = 0
    for layer in range(config.num_layers):
        for parts, out, inp in fused.values():
            r = sum(m.a.shape[0] for name, m in adapter.modules.items()
                    if name.startswith(f"layers.{layer}.") and name.rsplit(".", 1)[1] in parts)
            total += 4 * r * (inp + out)
    return total


def test_an_unloaded_then_reloaded_adapter_gives_the_same_logits(llama_dir, tmp_path):
    model = with_adapters(llama_dir, [adapter_dir(llama_dir, tmp_path)])

    def logits():
        return model(torch.tensor(PROMPT), 0, SequenceKVCache.for_model(model, len(PROMPT)), lora_slot=1)

    adapter = model.lora.adapters[0]
    model.lora.load(1, adapter)
    before = logits()
    model.lora.unload(1)
    model.lora.unload(0)
    model.lora.load(1, adapter)
    assert torch.equal(logits(), before)


# --- the native path ---

@native_only
@pytest.mark.parametrize("source", ["F32", "Q8_0"])
def test_native_logits_under_an_adapter_are_within_the_base_models_tolerance_of_peft(hf_dir, source, variant_adapter,
                                                                                     tmp_path):
    from test_native_model import TOLERANCE

    adapter = variant_adapter("rank8-rslora")
    gguf = write_gguf(hf_dir, tmp_path / f"m-{source}.gguf", source)
    model = with_adapters(gguf, [adapter], kernels_="native")
    assert model.backend.name == "native"
    compare_with_reference(model, peft_model(hf_dir, adapter, gguf), rtol=TOLERANCE[source])


@native_only
@pytest.mark.parametrize("qtype", ["F16", "Q4_0"])
def test_native_mixed_batch_gives_each_sequence_bitwise_what_it_gets_alone(hf_dir, mixed_adapters, qtype, tmp_path):
    gguf = write_gguf(hf_dir, tmp_path / f"m-{qtype}.gguf", qtype)
    model = with_adapters(gguf, mixed_adapters, kernels_="native")
    batched, alone = run_mixed(model)
    # float weights keep float32 activations: PEFT's within the reference path's tolerance. Quantized ones meet
    # 8-bit activations, which move these prompts' logits by up to ~4% without an adapter already (against
    # PEFT at the base model's tolerance: the test above)
    references = mixed_references(hf_dir, mixed_adapters, gguf) if qtype == "F16" else [None] * len(batched)
    for got, single, expected in zip(batched, alone, references):
        assert torch.equal(got, single)
        if expected is not None:
            assert_close_relative(got, expected)
    # the sequence under no adapter is bitwise the base model's
    base, _, _ = load_model(gguf, kernels="native")
    assert torch.equal(alone[MIXED_SLOTS.index(-1)], run_mixed_alone_base(base))


def run_mixed_alone_base(model):
    """The no-adapter sequence of the mixed batch, alone, on a model without LoRA (as run_mixed runs it)."""
    i = MIXED_SLOTS.index(-1)
    cache = PagedKVCache(model.config, num_blocks=64, block_size=4)
    table, prompt = list(range(8 * i, 8 * i + 8)), MIXED_PROMPTS[i]
    steps = [SequenceChunk(prompt, 0, table, all_logits=True), SequenceChunk(prompt + [DECODE[0]], len(prompt), table)]
    return torch.cat([model.forward_batch(ForwardBatch.build([c], cache.block_size), cache) for c in steps])
