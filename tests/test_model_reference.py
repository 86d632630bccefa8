"""churon's logits against transformers' on tiny random models, from safetensors and from GGUF.

The reference computes with exactly the weights stored in each file (tiny_models.reference_model),
so the only differences left are arithmetic order: 1e-4 relative to the largest logit in fp32.
"""

import json

import pytest
import torch

from churon.loader import load_model
from churon.engine.kv_cache import SequenceKVCache
from tiny_models import (
    DECODER_ARCHS,
    LLAMA3_ROPE_SCALING,
    LLAMA32_ROPE_SCALING,
    MAX_POSITIONS,
    PHI3_LONGROPE,
    SLIDING_WINDOW,
    make_hf_model,
    reference_model,
    write_gguf,
)

RTOL = 1e-4
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 8]
DECODE_STEPS = 20


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, rtol: float = RTOL) -> None:
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= rtol * scale, f"max |diff| {diff:.3g} > {rtol} x max |logit| {scale:.3g}"


def compare_prefill_and_decode(model_path, reference) -> None:
    """Prompt logits at every position, then 20 greedy decode steps through churon's KV cache."""
    transformer, _, _ = load_model(model_path, kernels="reference")
    cache = SequenceKVCache.for_model(transformer, len(PROMPT) + DECODE_STEPS)
    tokens = list(PROMPT)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    actual = transformer(torch.tensor(tokens), 0, cache, all_logits=True)
    assert actual.shape == expected.shape
    assert_close_relative(actual, expected)
    for _ in range(DECODE_STEPS):
        tokens.append(int(expected[-1].argmax()))
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0]
        actual = transformer(torch.tensor(tokens[-1:]), len(tokens) - 1, cache)
        assert_close_relative(actual[0], expected[-1])


@pytest.fixture(scope="module", params=DECODER_ARCHS)
def hf_dir(request, tmp_path_factory):
    return make_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def gguf_keeps_the_model(hf_dir) -> None:
    """llama.cpp's converter writes Mistral as llama, without its window: that file is another model."""
    if hf_dir.name.startswith("mistral"):
        pytest.skip("convert_hf_to_gguf.py drops Mistral's sliding window (the GGUF is a llama)")


def test_every_decoder_test_runs_past_the_window():
    assert len(PROMPT) + DECODE_STEPS > 2 * SLIDING_WINDOW


def test_safetensors_directory_matches_transformers(hf_dir):
    compare_prefill_and_decode(hf_dir, reference_model(hf_dir))


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0"])
def test_gguf_matches_transformers_on_the_stored_weights(hf_dir, qtype, tmp_path):
    gguf_keeps_the_model(hf_dir)
    path = write_gguf(hf_dir, tmp_path / f"model-{qtype}.gguf", qtype)
    compare_prefill_and_decode(path, reference_model(hf_dir, path))


def test_quantized_gguf_really_differs_from_the_fp32_model(hf_dir, tmp_path):
    """Guards the test above: the Q4_0 reference must not silently be the unquantized model."""
    gguf_keeps_the_model(hf_dir)
    path = write_gguf(hf_dir, tmp_path / "model-Q4_0.gguf", "Q4_0")
    transformer, _, _ = load_model(path, kernels="reference")
    with torch.no_grad():
        fp32 = reference_model(hf_dir)(torch.tensor([PROMPT])).logits[0]
    actual = transformer(torch.tensor(PROMPT), 0, SequenceKVCache.for_model(transformer), all_logits=True)
    assert (actual - fp32).abs().max() > 1e-3


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_llama3_rope_scaling(source, tmp_path):
    hf = make_hf_model("llama", tmp_path / "hf", rope_scaling=LLAMA3_ROPE_SCALING)
    path = hf if source == "hf" else write_gguf(hf, tmp_path / "m.gguf", "F32")
    compare_prefill_and_decode(path, reference_model(hf, None if source == "hf" else path))


@pytest.mark.parametrize("source", ["hf", "Q8_0"])
def test_llama_3_2(source, tmp_path):
    """Llama 3.2's shape: llama3 RoPE scaling with its factor 32 and base 500000, tied embeddings, head_dim 64."""
    hf = make_hf_model("llama", tmp_path / "hf", rope_scaling=LLAMA32_ROPE_SCALING, head_dim=64)
    path = hf if source == "hf" else write_gguf(hf, tmp_path / "m.gguf", source)
    compare_prefill_and_decode(path, reference_model(hf, None if source == "hf" else path))


# original_max_position_embeddings where transformers' factors (by each forward's length) are the ones churon picks
# by the context (model/rope.py): the whole context, every test's sequence within it: the short factors; 8
# positions, every test's sequence past them: the long ones, with cos and sin times 1.63
LONGROPE_ORIGINALS = {"short": MAX_POSITIONS, "long": 8}


@pytest.mark.parametrize("source", ["hf", "su", "gguf"])
@pytest.mark.parametrize("factors", list(LONGROPE_ORIGINALS))
def test_phi3_longrope(factors, source, tmp_path):
    """source "su": the transformers 4 layout, rope_scaling {"type": "su"} (Phi-3's first name for longrope) beside a
    top-level original_max_position_embeddings, which Phi3Config takes over the one rope_scaling has (and
    transformers 5 wants there too)."""
    assert len(PROMPT) > LONGROPE_ORIGINALS["long"]
    scaling = {**PHI3_LONGROPE, "original_max_position_embeddings": LONGROPE_ORIGINALS[factors]}
    hf = make_hf_model("phi3", tmp_path / "hf", rope_scaling=scaling, legacy_config=source == "su")
    if source == "su":
        cfg = json.loads((hf / "config.json").read_text())
        cfg["rope_scaling"] = {**scaling, "type": "su", "original_max_position_embeddings": 100}
        del cfg["rope_scaling"]["rope_type"]
        (hf / "config.json").write_text(json.dumps(cfg))
    path = write_gguf(hf, tmp_path / "m.gguf", "F32") if source == "gguf" else hf
    compare_prefill_and_decode(path, reference_model(hf, path if source == "gguf" else None))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_separate_output_embedding(arch, tmp_path):
    hf = make_hf_model(arch, tmp_path / "hf", tie_word_embeddings=False)
    compare_prefill_and_decode(hf, reference_model(hf))
    path = write_gguf(hf, tmp_path / "m.gguf", "F16")
    compare_prefill_and_decode(path, reference_model(hf, path))


def test_sharded_safetensors_with_index(tmp_path):
    hf = make_hf_model("qwen3", tmp_path / "hf", shard=True)
    assert len(list(hf.glob("*.safetensors"))) > 1
    compare_prefill_and_decode(hf, reference_model(hf))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_transformers_4_style_config(arch, tmp_path):
    hf = make_hf_model(arch, tmp_path / "hf", legacy_config=True)
    compare_prefill_and_decode(hf, reference_model(hf))


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_gemma3_final_logit_softcap(source, tmp_path):
    """A Gemma 3 with Gemma 2's final soft-cap (a field every released Gemma 3 leaves null), from both files."""
    hf = make_hf_model("gemma3", tmp_path / "hf", final_logit_softcapping=4.0)
    path = hf if source == "hf" else write_gguf(hf, tmp_path / "m.gguf", "F32")
    compare_prefill_and_decode(path, reference_model(hf, None if source == "hf" else path))


def test_gemma_query_scale_of_its_own(tmp_path):
    """query_pre_attn_scalar apart from head_dim (as Gemma 2 27B has), from a directory (a GGUF cannot say it)."""
    hf = make_hf_model("gemma3", tmp_path / "hf", query_pre_attn_scalar=24)
    compare_prefill_and_decode(hf, reference_model(hf))


# gpt-oss's tiny experts have gate/up weights large enough for its SwiGLU's clamps (tiny_models.GPT_OSS_GATE_UP_STD):
# their outputs reach tens, and bf16's 8 bits of mantissa on them move the logits by 17% (at the other families' weight
# scale, where nothing clamps, by 4%)
BF16_TOLERANCE = {"gpt_oss": 0.2}


def test_bf16_activations_stay_close(hf_dir):
    """bf16 is a speed/memory option, not exact: its logits stay within a few percent."""
    transformer, _, _ = load_model(hf_dir, dtype="bfloat16", kernels="reference")
    with torch.no_grad():
        expected = reference_model(hf_dir)(torch.tensor([PROMPT])).logits[0]
    actual = transformer(torch.tensor(PROMPT), 0, SequenceKVCache.for_model(transformer), all_logits=True)
    assert_close_relative(actual, expected, rtol=BF16_TOLERANCE.get(hf_dir.name.rstrip("0123456789"), 0.05))
