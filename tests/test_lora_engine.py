"""LoRA adapters in the serving engine: PEFT's greedy tokens, many adapters in one batch bitwise as alone,
a prefix cache keyed by adapter, unloading under running requests, and the errors.

PEFT (with transformers) is the reference for what an adapter computes; a request run alone in an engine
of its own is the reference for what it computes batched beside others (native kernels)."""

import asyncio
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from churon import LLM, SamplingParams
from churon.config import EngineConfig
from churon.engine import AsyncLLMEngine, LLMEngine
from churon.engine.lora import UnknownLoraError
from churon.errors import ModelFileError
from churon.formats.lora import read_lora, write_lora_gguf
from churon.loader import load_model
from tiny_models import ARCHS, make_hf_model, make_peft_adapter, peft_model, reference_model

def greedy(lora=None, scale=1.0, max_tokens=16) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora=lora, lora_scale=scale)


def engine(model_and_tokenizer, **options) -> LLMEngine:
    options.setdefault("kv_cache_memory", 4 << 20)
    return LLMEngine(*model_and_tokenizer, EngineConfig(**options))


def prompts(n: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Four adapters of the tiny llama: ranks, rsLoRA, attention-only and MLP-only targets."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_peft_adapter(tiny_llama_dir, root / "a", rank=4, seed=1),
        "b": make_peft_adapter(tiny_llama_dir, root / "b", rank=8, alpha=16.0, use_rslora=True, seed=2),
        "c": make_peft_adapter(tiny_llama_dir, root / "c", rank=2, targets=("q_proj", "v_proj", "o_proj"), seed=3),
        "d": make_peft_adapter(tiny_llama_dir, root / "d", rank=6, targets=("gate_proj", "up_proj", "down_proj"), seed=4),
    }


def native_model(path):
    """A fresh native model (each engine serving adapters owns its model's LoRA slots)."""
    return load_model(path, kernels="native")[:2]


def loaded(model_and_tokenizer, adapters, names=("a", "b", "c", "d"), **options) -> LLMEngine:
    eng = engine(model_and_tokenizer, **options)
    for name in names:
        eng.add_lora(name, adapters[name])
    return eng


def peft_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


# -- what an adapter computes ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_with_an_adapter_are_pefts(arch, tmp_path):
    hf = make_hf_model(arch, tmp_path / "model")
    adapter = make_peft_adapter(hf, tmp_path / "lora", rank=4, alpha=8.0, seed=5, std=0.2)
    half = make_peft_adapter(hf, tmp_path / "half", rank=4, alpha=4.0, seed=5, std=0.2)  # the same A, B at half scale
    prompt = prompts(1, seed=6)[0] + [7, 8, 9]
    eng = engine(load_model(hf, kernels="reference")[:2])
    eng.add_lora("lora", adapter)
    out = eng.generate([prompt] * 3, [greedy(), greedy("lora"), greedy("lora", 0.5)])
    base, tuned, scaled = (o.token_ids for o in out)
    assert tuned == peft_greedy(peft_model(hf, adapter), prompt, 16)
    assert scaled == peft_greedy(peft_model(hf, half), prompt, 16)  # lora_scale multiplies alpha / r
    assert base == peft_greedy(reference_model(hf), prompt, 16)
    assert tuned != base


def test_a_batch_mixing_four_adapters_and_none_gives_each_request_its_solo_output(tiny_llama_q8, adapters):
    ps = prompts(20, seed=1, shared_prefix=20)
    names = [None, "a", "b", "c", "d"]
    params = []
    for i in range(len(ps)):
        lora, scale = names[i % 5], 0.5 if i % 7 == 3 else 1.0
        if i % 2:
            params.append(greedy(lora, scale, max_tokens=12))
        else:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True,
                                         lora=lora, lora_scale=scale))
    solo_engine = loaded(native_model(tiny_llama_q8), adapters, enable_prefix_caching=False)
    solo = [solo_engine.generate([p], [sp])[0].token_ids for p, sp in zip(ps, params)]
    for options in ({}, {"max_num_batched_tokens": 7}, {"block_size": 4, "kv_cache_memory": 48 * 1024}):
        eng = loaded(native_model(tiny_llama_q8), adapters, **options)
        assert [o.token_ids for o in eng.generate(ps, params)] == solo, options
        if "kv_cache_memory" in options:
            assert eng.scheduler.num_preemptions > 0
    # the adapters matter: the same prompt under each gives other tokens
    shared = [solo_engine.generate([ps[0]], [greedy(n)])[0].token_ids for n in names]
    assert len({tuple(t) for t in shared}) == len(names)


def test_a_gguf_adapter_serves_as_its_peft_directory_does(tiny_llama_q8, adapters, tmp_path):
    model_and_tokenizer = native_model(tiny_llama_q8)
    config = model_and_tokenizer[0].config
    eng = engine(model_and_tokenizer)
    for name in ("a", "b"):  # b is rsLoRA: its scales go into B in the GGUF
        eng.add_lora(name, adapters[name])
        eng.add_lora(name + ".gguf", write_lora_gguf(read_lora(adapters[name]), config, tmp_path / f"{name}.gguf"))
    prompt = [random.Random(7).randrange(3, 300) for _ in range(40)]
    for name in ("a", "b"):
        peft_out, gguf_out = eng.generate([prompt, prompt], [greedy(name), greedy(name + ".gguf")])
        assert peft_out.token_ids == gguf_out.token_ids
        assert gguf_out.metrics.cached_prompt_tokens == 0  # another load: another adapter to the prefix cache


# -- the prefix cache --------------------------------------------------------------------------------


def test_the_prefix_cache_never_crosses_adapters(tiny_llama_q8, adapters):
    prompt = [random.Random(2).randrange(3, 300) for _ in range(53)]  # three full blocks of 16 cached, and a tail
    keys = [("a", 1.0), ("b", 1.0), (None, 1.0), ("a", 0.5)]
    eng = loaded(native_model(tiny_llama_q8), adapters, names=("a", "b"))
    cold = loaded(native_model(tiny_llama_q8), adapters, names=("a", "b"), enable_prefix_caching=False)
    expected = [cold.generate([prompt], [greedy(n, s)])[0].token_ids for n, s in keys]
    first = [eng.generate([prompt], [greedy(n, s)])[0] for n, s in keys]
    again = [eng.generate([prompt], [greedy(n, s)])[0] for n, s in keys]
    assert [o.metrics.cached_prompt_tokens for o in first] == [0] * 4  # no hits across adapters or scales
    assert [o.metrics.cached_prompt_tokens for o in again] == [48] * 4  # hits within each
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    # loaded again under the same name, an adapter is another adapter: none of the old one's blocks
    eng.remove_lora("a")
    eng.add_lora("a", adapters["c"])
    out = eng.generate([prompt], [greedy("a")])[0]
    assert out.metrics.cached_prompt_tokens == 0
    cold.add_lora("c", adapters["c"])
    assert out.token_ids == cold.generate([prompt], [greedy("c")])[0].token_ids != expected[0]


# -- unloading under running requests -----------------------------------------------------------------


def test_remove_lora_while_a_request_uses_it(tiny_llama_q8, adapters):
    prompt = prompts(1, seed=3)[0]
    reference = loaded(native_model(tiny_llama_q8), adapters, names=("a", "d"), enable_prefix_caching=False)
    expected_a = reference.generate([prompt], [greedy("a", max_tokens=30)])[0].token_ids
    expected_d = reference.generate([prompt], [greedy("d", max_tokens=30)])[0].token_ids

    eng = loaded(native_model(tiny_llama_q8), adapters, names=("a", "b"), max_loras=2)
    running = eng.add_request(prompt, greedy("a", max_tokens=30))
    for _ in range(5):
        eng.step()
    slot = eng.lora.get("a").slot
    eng.remove_lora("a")
    assert eng.lora_names() == ("b",)
    with pytest.raises(UnknownLoraError, match=r"no LoRA adapter named 'a' is loaded \(loaded: b\)"):
        eng.add_request(prompt, greedy("a"))
    with pytest.raises(ValueError, match=r"max_loras=2 adapters are loaded \(b, a \(unloads once its 1 requests end\)\)"):
        eng.add_lora("d", adapters["d"])
    assert eng.lora.slots.adapters[slot] is not None  # still serving the running request
    outputs = {}
    while eng.has_unfinished():
        outputs.update((d.request_id, d.output) for d in eng.step() if d.finish_reason)
    assert outputs[running].token_ids == expected_a  # completed unchanged
    assert eng.lora.slots.adapters[slot] is None  # freed when it ended
    eng.add_lora("d", adapters["d"])  # the freed slot takes a new adapter, with none of the old one's weights
    assert eng.lora.get("d").slot == slot
    assert eng.generate([prompt], [greedy("d", max_tokens=30)])[0].token_ids == expected_d


def test_kv_blocks_and_slots_back_to_baseline_after_64_mixed_requests(tiny_llama_q8, adapters):
    eng = loaded(native_model(tiny_llama_q8), adapters, block_size=4)
    names = [None, "a", "b", "c", "d"]
    ps = prompts(64, seed=4, shared_prefix=12)
    ids = [eng.add_request(p, greedy(names[i % 5], 1.0 - (i % 3) * 0.25, max_tokens=4 + i % 9)) for i, p in enumerate(ps)]
    for _ in range(4):
        eng.step()
    for i in ids[::7]:
        eng.abort(i)
    eng.remove_lora("c")  # unloads once its last request ends
    streamed = eng.stream(ps[0], greedy("b", max_tokens=50))
    next(streamed)
    streamed.close()  # a stream left early
    while eng.has_unfinished():
        eng.step()
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.requests
    assert [eng.lora.get(n).num_requests for n in ("a", "b", "d")] == [0, 0, 0]
    assert sum(a is not None for a in eng.lora.slots.adapters) == 3  # c's slot went back


# -- the front doors ---------------------------------------------------------------------------------


def test_llm_lora_adapters_load_and_unload(tiny_llama_dir, adapters):
    llm = LLM(tiny_llama_dir, kernels="reference", threads=1, kv_cache_memory=4 << 20, lora_adapters={"a": adapters["a"]},
              max_loras=2, max_lora_rank=8)
    assert llm.lora_adapters == ("a",)
    prompt = prompts(1, seed=5)[0]
    reference = engine(load_model(tiny_llama_dir, kernels="reference")[:2])
    reference.add_lora("a", adapters["a"])
    reference.add_lora("b", adapters["b"])
    assert llm.generate([prompt], greedy("a"), use_tqdm=False)[0].token_ids == reference.generate([prompt], greedy("a"))[0].token_ids
    llm.load_lora("b", adapters["b"])
    assert llm.lora_adapters == ("a", "b")
    text = "".join(llm.stream(prompt, greedy("b")))
    assert text == reference.generate([prompt], greedy("b"))[0].text
    llm.unload_lora("a")
    assert llm.lora_adapters == ("b",)
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        llm.generate([prompt], greedy("a"))


def test_async_engine_loads_and_unloads_from_the_event_loop(tiny_llama_q8, adapters):
    sync_engine = loaded(native_model(tiny_llama_q8), adapters, names=("a",))
    async_engine = AsyncLLMEngine(engine(native_model(tiny_llama_q8)))
    prompt = prompts(1, seed=6)[0]

    async def main():
        await async_engine.add_lora("a", adapters["a"])
        assert async_engine.lora_names() == ("a",)
        out = [d async for d in async_engine.generate(prompt, greedy("a"))][-1].output
        with pytest.raises(ValueError, match="loaded already"):
            await async_engine.add_lora("a", adapters["b"])
        await async_engine.remove_lora("a")
        with pytest.raises(UnknownLoraError, match="none is loaded"):
            await async_engine.remove_lora("a")
        return out

    try:
        out = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert out.token_ids == sync_engine.generate([prompt], greedy("a"))[0].token_ids
    assert async_engine.lora_names() == ()


# -- errors ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_llama(tiny_llama_dir):
    return load_model(tiny_llama_dir, kernels="reference")[:2]


def test_an_unknown_adapter_is_a_clear_error_and_queues_nothing(reference_llama, adapters):
    eng = engine(reference_llama)
    with pytest.raises(UnknownLoraError, match=r"no LoRA adapter named 'x' is loaded \(none is loaded\)"):
        eng.add_request([5, 6], greedy("x"))
    with pytest.raises(UnknownLoraError, match="none is loaded"):
        eng.remove_lora("x")
    eng = loaded(reference_llama, adapters, names=("a", "b"))
    with pytest.raises(ValueError, match=r"no LoRA adapter named 'x' is loaded \(loaded: a, b\)"):
        eng.generate([[5, 6], [7, 8]], [greedy("a"), greedy("x")])
    assert not eng.has_unfinished() and eng.lora.get("a").num_requests == 0


def test_loading_errors_leave_the_slots_as_they_were(tiny_llama_dir, adapters, tmp_path):
    model_and_tokenizer = load_model(tiny_llama_dir, kernels="reference")[:2]
    eng = engine(model_and_tokenizer, max_loras=2, max_lora_rank=6)
    eng.add_lora("a", adapters["a"])
    with pytest.raises(ValueError, match="'a' is loaded already"):
        eng.add_lora("a", adapters["c"])
    with pytest.raises(ModelFileError, match="rank"):  # b has rank 8
        eng.add_lora("b", adapters["b"])
    # an adapter for another model: q_proj's A made for a hidden size of 32
    wrong = shutil.copytree(adapters["a"], tmp_path / "wrong")
    tensors = load_file(wrong / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_A" in k)
    tensors[key] = tensors[key][:, :32].contiguous()
    save_file(tensors, wrong / "adapter_model.safetensors")
    with pytest.raises(ModelFileError, match="q_proj"):
        eng.add_lora("wrong", wrong)
    with pytest.raises(ModelFileError):
        eng.add_lora("missing", tmp_path / "nothing-here")
    assert eng.lora_names() == ("a",)
    eng.add_lora("c", adapters["c"])
    with pytest.raises(ValueError, match=r"cannot load LoRA adapter 'd': max_loras=2 adapters are loaded \(a, c\)"):
        eng.add_lora("d", adapters["d"])
    with pytest.raises(ValueError, match="max_loras=0"):
        engine(load_model(tiny_llama_dir, kernels="reference")[:2], max_loras=0).add_lora("a", adapters["a"])


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 1e9, -17.0, True, "1"])
def test_a_bad_lora_scale_is_refused(scale):
    with pytest.raises(ValueError, match="lora_scale"):
        SamplingParams(lora="a", lora_scale=scale)


@pytest.mark.parametrize("field, value", [("max_loras", -1), ("max_loras", 1.5), ("max_loras", 257), ("max_lora_rank", 0),
                                          ("max_lora_rank", None), ("max_lora_rank", 4097)])
def test_bad_lora_engine_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"invalid engine setting {field}={value!r}: must be an integer in"):
        EngineConfig(**{field: value})
    assert EngineConfig(max_loras=256, max_lora_rank=4096).max_loras == 256  # the bounds themselves are allowed


def test_a_bad_lora_name_is_refused():
    with pytest.raises(ValueError, match="invalid sampling parameter lora=''"):
        SamplingParams(lora="")
    assert SamplingParams(lora="a", lora_scale=-16).lora_scale == -16  # the bounds are in range


def test_a_scale_changed_on_the_params_after_add_request_changes_nothing(tiny_llama_q8, adapters):
    """The engine takes a request's adapter and scale when it is added: its blocks are hashed under that scale, so
    running later tokens under a new value of the (shared, mutable) params would put K/V computed at one scale
    into the prefix cache under the other's hashes, for other requests to hit."""
    prompt = prompts(1, seed=7, shared_prefix=40)[0]
    reference = loaded(native_model(tiny_llama_q8), adapters, names=("a",), enable_prefix_caching=False)
    expected = reference.generate([prompt], [greedy("a", 1.0, max_tokens=20)])[0].token_ids

    eng = loaded(native_model(tiny_llama_q8), adapters, names=("a",), block_size=4, max_num_batched_tokens=16)
    params = greedy("a", 1.0, max_tokens=20)
    first = eng.add_request(prompt, params)
    eng.step()  # the first 16 prompt tokens, at scale 1
    params.lora_scale = 4.0  # the caller reuses its params for a request of its own
    outputs = {}
    while eng.has_unfinished():
        outputs.update((d.request_id, d.output) for d in eng.step() if d.finish_reason)
    assert outputs[first].token_ids == expected
    # a later request at scale 1 hits the blocks the first one cached: they hold scale-1 K/V
    again = eng.generate([prompt], [greedy("a", 1.0, max_tokens=20)])[0]
    assert again.metrics.cached_prompt_tokens > 0 and again.token_ids == expected


@pytest.mark.parametrize("value", ["adapter-dir", ["adapter-dir"]])
def test_lora_adapters_that_are_not_a_mapping_are_refused(value):
    with pytest.raises(ValueError, match=r"lora_adapters=.*adapter-dir.*: must map names to adapter paths"):
        LLM("no-such-model", lora_adapters=value)
