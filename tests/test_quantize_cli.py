"""`churon quantize` and quantize_model: files that load back in churon and in llama.cpp, type choices that
match llama-quantize's, --keep / --target-bpw, and clear errors for bad arguments.

References: transformers (tiny_models.reference_model, with the weights read from our file) for churon's
reading of the file; llama-cpp-python 0.3.36 for llama.cpp's, and its llama_model_quantize for the type
llama.cpp gives each tensor.

The tiny models here are "wide" (hidden 256, intermediate 512) so that K-quant blocks of 256 fit their rows;
tiny_models' own sizes (hidden 64) exercise llama.cpp's fallbacks instead.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import tiny_models
from churon import LLM, SamplingParams
from churon.cli import main
from churon.formats.gguf import GGUFModel
from churon.formats.hf import HFModel
from churon.formats.gguf_writer import GGUFModelWriter, TensorSpec
from churon.formats.quants import dequantize, quantize
from churon.quantize import quantize_model
from churon.quantize.mixed import spend_budget
from churon.engine.kv_cache import SequenceKVCache
from llama_cpp_peer import llama_cpp_greedy, llama_cpp_logits, llama_cpp_model
from tiny_models import make_hf_model, reference_model, write_gguf

llama_cpp = pytest.importorskip("llama_cpp")

PROMPT_TEXT = "The quick brown fox jumps over"
CALIB_TEXT = tiny_models.TRAINING_TEXT * 2  # a bit over one 512-token window with the tiny tokenizer


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """arch -> HF directory of a tiny model with hidden 256 and intermediate 512 (head_dim 64)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "HIDDEN", 256)
        mp.setattr(tiny_models, "INTERMEDIATE", 512)
        mp.setattr(tiny_models, "HEAD_DIM", 64)
        for arch in ("llama", "qwen2", "qwen3"):
            out[arch] = make_hf_model(arch, tmp_path_factory.mktemp(f"wide-{arch}"))
    return out


def gguf_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def churon_logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    return llm.model(torch.tensor(tokens), 0, SequenceKVCache.for_model(llm.model, len(tokens)), all_logits=True)


def greedy(llm: LLM, prompt: list[int], n: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids


# --- churon reads back what it wrote


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K"])
def test_quantized_file_loads_back_in_churon(wide_models, tmp_path, arch, qtype):
    hf = wide_models[arch]
    out = tmp_path / "m.gguf"
    report = quantize_model(hf, out, qtype, progress=False, pure=True)
    assert report.path == out and out.stat().st_size == report.file_bytes
    assert {t.qtype.name for t in report.tensors if len(t.shape) == 2} == {qtype}
    # the weights churon reads from the file are the HF weights up to rounding (q/k rows in HF order again)
    original = HFModel(hf).load_weights()
    for name, w in GGUFModel(out).load_weights().items():
        restored = dequantize(w.data, w.qtype, w.shape)
        assert float((restored - original[name]).norm() / original[name].norm()) < 0.1, name
    # and it computes what transformers computes with those weights
    llm = LLM(out, threads=1, kernels="reference")
    ids = llm.tokenizer.encode(PROMPT_TEXT)
    want = reference_model(hf, out)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(churon_logits(llm, ids), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch, rope_scaling", [("llama", tiny_models.LLAMA3_ROPE_SCALING), ("qwen2", None)])
def test_hf_source_converts_like_convert_hf_to_gguf(tmp_path, arch, rope_scaling):
    """At F32, churon's HF -> GGUF conversion equals tiny_models.write_gguf (which follows llama.cpp's
    convert_hf_to_gguf.py): the same tensors, bytes for bytes (llama q/k permuted, rope_freqs for Llama 3
    scaling), and the same metadata values."""
    hf = make_hf_model(arch, tmp_path / "hf", rope_scaling=rope_scaling)
    ours = gguf.GGUFReader(quantize_model(hf, tmp_path / "ours.gguf", "F32", progress=False).path)
    theirs = gguf.GGUFReader(write_gguf(hf, tmp_path / "theirs.gguf", "F32"))
    assert sorted(t.name for t in ours.tensors) == sorted(t.name for t in theirs.tensors)
    by_name = {t.name: t for t in theirs.tensors}
    for t in ours.tensors:
        assert t.tensor_type == by_name[t.name].tensor_type, t.name
        np.testing.assert_array_equal(np.array(t.data), np.array(by_name[t.name].data), err_msg=t.name)
    skip = {"general.name"}
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.") and k not in skip}
    got = {k: f.contents() for k, f in ours.fields.items() if not k.startswith("GGUF.") and k not in skip}
    assert got == want


def test_gguf_source_gives_the_same_file_as_hf_source(wide_models, tmp_path):
    hf = wide_models["llama"]
    f32 = write_gguf(hf, tmp_path / "f32.gguf", "F32")
    a = quantize_model(hf, tmp_path / "a.gguf", "Q4_K", progress=False)
    b = quantize_model(f32, tmp_path / "b.gguf", "Q4_K", progress=False)
    ta = {t.name: (t.tensor_type, np.array(t.data)) for t in gguf.GGUFReader(a.path).tensors}
    tb = {t.name: (t.tensor_type, np.array(t.data)) for t in gguf.GGUFReader(b.path).tensors}
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name][0] == tb[name][0], name
        np.testing.assert_array_equal(ta[name][1], tb[name][1], err_msg=name)


def test_sharded_hf_source_gives_the_same_tensors(tmp_path):
    """Tensors are read one at a time from whichever shard holds them: a sharded checkpoint quantizes
    (calibration included) to the same tensors as the same weights in one file."""
    whole = make_hf_model("qwen2", tmp_path / "whole")
    sharded = make_hf_model("qwen2", tmp_path / "sharded", shard=True)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    files = [quantize_model(hf, tmp_path / f"{hf.name}.gguf", "Q4_0", method="gptq", calib_text=CALIB_TEXT,
                            progress=False).path for hf in (whole, sharded)]
    a, b = ({t.name: np.array(t.data) for t in gguf.GGUFReader(f).tensors} for f in files)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_writer_checks_what_it_is_given(wide_models, tmp_path):
    source = HFModel(wide_models["llama"])
    specs = [TensorSpec("a.weight", (2, 32), gguf.GGMLQuantizationType.Q8_0),
             TensorSpec("b.weight", (4,), gguf.GGMLQuantizationType.F32)]
    raw_a = quantize(torch.ones(2, 32), "Q8_0")
    with pytest.raises(ValueError, match="tensor 'c.weight' was not declared"):
        with GGUFModelWriter(tmp_path / "x.gguf", source, specs, gguf.LlamaFileType.MOSTLY_Q8_0) as w:
            w.write("c.weight", np.zeros(4, np.float32))
    assert not (tmp_path / "x.gguf").exists()  # no half-written file left behind
    with pytest.raises(ValueError, match="tensor 'a.weight' was not declared, or was written already"):
        with GGUFModelWriter(tmp_path / "x.gguf", source, specs, gguf.LlamaFileType.MOSTLY_Q8_0) as w:
            w.write("a.weight", raw_a)
            w.write("a.weight", raw_a)
    with pytest.raises(ValueError, match=r"'a.weight' \(Q8_0 \[2, 32\]\) needs 68 bytes, got 64"):
        with GGUFModelWriter(tmp_path / "x.gguf", source, specs, gguf.LlamaFileType.MOSTLY_Q8_0) as w:
            w.write("a.weight", np.zeros(64, np.uint8))
    with pytest.raises(ValueError, match=r"tensors not written: \['b.weight'\]"):
        with GGUFModelWriter(tmp_path / "x.gguf", source, specs, gguf.LlamaFileType.MOSTLY_Q8_0) as w:
            w.write("a.weight", raw_a)
    with GGUFModelWriter(tmp_path / "x.gguf", source, specs, gguf.LlamaFileType.MOSTLY_Q8_0) as w:
        w.write("a.weight", raw_a)
        w.write("b.weight", np.arange(4, dtype=np.float32))
    with GGUFModelWriter(tmp_path / "y.gguf", source, specs, gguf.LlamaFileType.MOSTLY_Q8_0) as w:
        w.write("b.weight", np.arange(4, dtype=np.float32))  # in any order: each tensor goes to its place
        w.write("a.weight", raw_a)
    assert (tmp_path / "x.gguf").read_bytes() == (tmp_path / "y.gguf").read_bytes()
    reader = gguf.GGUFReader(tmp_path / "x.gguf")
    assert [(t.name, t.tensor_type.name) for t in reader.tensors] == [("a.weight", "Q8_0"), ("b.weight", "F32")]
    np.testing.assert_array_equal(np.array(reader.tensors[1].data), np.arange(4, dtype=np.float32))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"


# --- llama.cpp reads what churon wrote


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_llama_cpp_greedy_matches_churon_on_f32(wide_models, tmp_path, arch):
    """Without rounding in between, llama.cpp and churon agree to ~1e-2 in the logits: same greedy tokens."""
    out = quantize_model(wide_models[arch], tmp_path / "m.gguf", "F32", progress=False).path
    llm = LLM(out, threads=1, kernels="reference")
    prompt = llm.tokenizer.encode(PROMPT_TEXT)
    m = llama_cpp_model(out)
    assert m.tokenize(PROMPT_TEXT.encode(), add_bos=False, special=False) == prompt
    assert llama_cpp_greedy(out, prompt, 16) == greedy(llm, prompt, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K"])
def test_llama_cpp_agrees_with_churon_on_quantized_file(wide_models, tmp_path, arch, qtype):
    """llama.cpp rounds activations to 8 bits in its quantized dot products, which moves a random tiny
    model's logits by a few percent; rounding the weights to 4 bits moves them by ~60%. So: along churon's
    greedy path, llama.cpp's logits must be far closer to churon's on the same file than the quantization
    moved them, and pick the same token wherever churon's top two differ by more than 0.5."""
    hf = wide_models[arch]
    f32 = quantize_model(hf, tmp_path / "f32.gguf", "F32", progress=False).path
    out = quantize_model(hf, tmp_path / "m.gguf", qtype, progress=False, pure=True).path
    llm = LLM(out, threads=1, kernels="reference")
    prompt = llm.tokenizer.encode(PROMPT_TEXT)
    seq = prompt + greedy(llm, prompt, 16)
    scored = slice(len(prompt) - 1, len(seq) - 1)  # the positions that chose the 16 greedy tokens
    ours = churon_logits(llm, seq)[scored]
    theirs = llama_cpp_logits(out, seq)[scored]
    unquantized = churon_logits(LLM(f32, threads=1, kernels="reference"), seq)[scored]
    assert float((theirs - ours).norm()) < 0.15 * float((unquantized - ours).norm())
    top2 = ours.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert int(clear.sum()) >= 6  # enough of the 16 to check (7 for Q4_K llama with torch on an AMX Xeon, 8+ elsewhere)
    assert bool((ours.argmax(-1) == theirs.argmax(-1))[clear].all())


def _llama_cpp_quantize(src, dst, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) == 0


@pytest.mark.parametrize("wide", [True, False], ids=["hidden256", "hidden64"])
@pytest.mark.parametrize("qtype, ftype", [("Q4_0", gguf.LlamaFileType.MOSTLY_Q4_0),
                                          ("Q4_K", gguf.LlamaFileType.MOSTLY_Q4_K_M),
                                          ("Q5_K", gguf.LlamaFileType.MOSTLY_Q5_K_M),
                                          ("Q8_0", gguf.LlamaFileType.MOSTLY_Q8_0)])
def test_default_types_match_llama_quantize(wide_models, tmp_path, qtype, ftype, wide):
    hf = wide_models["llama"] if wide else make_hf_model("llama", tmp_path / "narrow", tie_word_embeddings=False)
    f32 = write_gguf(hf, tmp_path / "f32.gguf", "F32")
    _llama_cpp_quantize(f32, tmp_path / "theirs.gguf", int(ftype))
    ours = quantize_model(f32, tmp_path / "ours.gguf", qtype, progress=False)
    assert gguf_types(ours.path) == gguf_types(tmp_path / "theirs.gguf")


# --- mixed precision


def test_keep_patterns(wide_models, tmp_path):
    report = quantize_model(wide_models["qwen2"], tmp_path / "m.gguf", "Q4_0", progress=False,
                            keep=["blk.*.ffn_down.weight=Q8_0", "blk.1.attn_q.weight=F16"])
    types = gguf_types(report.path)
    assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down.weight"] == "Q8_0"
    assert types["blk.1.attn_q.weight"] == "F16" and types["blk.0.attn_q.weight"] == "Q4_0"
    assert types["blk.0.attn_q.bias"] == "F32"  # 1-D tensors stay F32
    assert report.kept == ["blk.0.ffn_down.weight", "blk.1.attn_q.weight", "blk.1.ffn_down.weight"]
    LLM(report.path, threads=1)  # loads


def test_target_bpw_spends_the_budget(wide_models, tmp_path):
    hf = wide_models["llama"]
    base = quantize_model(hf, tmp_path / "base.gguf", "Q4_K", progress=False, pure=True)
    target = base.bits_per_weight + 1.0
    mixed = quantize_model(hf, tmp_path / "mixed.gguf", "Q4_K", progress=False, pure=True, target_bpw=target,
                           calib_text=CALIB_TEXT)
    assert base.bits_per_weight + 0.5 < mixed.bits_per_weight <= target
    assert {t.qtype.name for t in mixed.tensors if len(t.shape) == 2} > {"Q4_K"}
    LLM(mixed.path, threads=1)  # loads


def test_budget_goes_to_the_most_sensitive_tensor_first():
    """Two tensors, room to raise one of them from Q4_K to Q5_K: the one Q4_K rounds is chosen, not the one
    whose values already lie on a 4-bit grid (nothing to gain)."""
    g = torch.Generator().manual_seed(0)
    weights = {
        "blk.0.attn_q.weight": torch.randint(0, 16, (64, 256), generator=g).float(),  # exact in Q4_K
        "blk.0.attn_k.weight": torch.randn(64, 256, generator=g),
    }
    shapes = {n: tuple(w.shape) for n, w in weights.items()}
    types = dict.fromkeys(weights, gguf.GGMLQuantizationType.Q4_K)
    one_step = 4.5 + (5.5 - 4.5) / 2  # bits per weight over both tensors
    chosen = spend_budget(types, shapes, list(weights), one_step, weights.__getitem__, lambda n: None)
    assert chosen == {"blk.0.attn_q.weight": gguf.GGMLQuantizationType.Q4_K,
                      "blk.0.attn_k.weight": gguf.GGMLQuantizationType.Q5_K}


# --- the command line


def test_cli_quantize(wide_models, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(wide_models["qwen3"]), str(out), "--type", "q4_k", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "Q4_K" in printed and "Q6_K" in printed and "bits per weight" in printed and str(out) in printed
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--type", "Q3_Z"], "unknown quantization type 'Q3_Z'"),
        (["--type", "Q4_0", "--method", "best"], "unknown quantization method 'best'"),
        (["--type", "Q4_0", "--method", "imatrix", "--calib", "{tmp}/missing.txt"], "--calib {tmp}/missing.txt: cannot read"),
        (["--type", "Q4_0", "--keep", "output.weight"], "expected PATTERN=TYPE"),
        (["--type", "Q4_0", "--keep", "nothing.*=Q8_0"], "'nothing.*' matches no 2-D tensor"),
        (["--type", "Q4_0", "--keep", "output.weight=Q9"], "unknown quantization type 'Q9'"),
        (["--type", "Q4_0", "--target-bpw", "3"], "--target-bpw 3 is below the"),
        (["--type", "Q4_0", "--target-bpw", "-1"], "--target-bpw must be positive"),
    ],
)
def test_cli_bad_arguments(wide_models, tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["quantize", str(wide_models["llama"]), str(tmp_path / "m.gguf"), *args, "-q"]) == 1
    assert message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


def test_cli_unreadable_source_and_output(wide_models, tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model")
    cases = [
        ([str(tmp_path / "absent"), str(tmp_path / "m.gguf")], "absent: no such file or directory"),
        ([str(junk), str(tmp_path / "m.gguf")], "junk.gguf: not a GGUF file"),
        ([str(wide_models["llama"]), str(tmp_path / "no" / "m.gguf")], "cannot write the output file there"),
    ]
    for argv, message in cases:
        assert main(["quantize", *argv, "--type", "Q4_0", "-q"]) == 1
        assert message in capsys.readouterr().err


# --- the real model


@pytest.mark.slow
def test_smollm2_q4_k_loads_in_churon_and_llama_cpp(smollm2_gguf, tmp_path):
    out = tmp_path / "smollm2-q4k.gguf"
    assert main(["quantize", str(smollm2_gguf), str(out), "--type", "Q4_K", "-q"]) == 0
    llm = LLM(out)
    prompt = llm.tokenizer.encode("The capital of France is")
    assert llama_cpp_greedy(out, prompt, 8) == greedy(llm, prompt, 8)


@pytest.mark.slow
def test_smollm2_types_and_size_match_llama_quantize(smollm2_gguf, tmp_path):
    """SmolLM2's rows of 576 values do not fit K-quant blocks: the fallbacks and the Q8_0 output decide the size.
    (llama.cpp requantizes from the Q4_1 file through float32, as churon does.)"""
    for qtype, ftype in [("Q4_0", gguf.LlamaFileType.MOSTLY_Q4_0), ("Q4_K", gguf.LlamaFileType.MOSTLY_Q4_K_M)]:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread, params.allow_requantize = int(ftype), 2, True
        theirs = tmp_path / f"theirs-{qtype}.gguf"
        assert llama_cpp.llama_model_quantize(str(smollm2_gguf).encode(), str(theirs).encode(), params) == 0
        ours = quantize_model(smollm2_gguf, tmp_path / f"ours-{qtype}.gguf", qtype, progress=False)
        assert gguf_types(ours.path) == gguf_types(theirs)
        assert ours.file_bytes == theirs.stat().st_size
        # the bytes too: all of them for the 32-value types (no search), nearly all K-quant blocks
        ours_data = {t.name: np.array(t.data).view(np.uint8) for t in gguf.GGUFReader(ours.path).tensors}
        same = total = 0
        for t in gguf.GGUFReader(theirs).tensors:
            size = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
            equal = (np.array(t.data).view(np.uint8).reshape(-1, size) == ours_data[t.name].reshape(-1, size)).all(1)
            if t.tensor_type.name in ("Q4_K", "Q6_K"):
                same, total = same + int(equal.sum()), total + equal.size
            else:
                assert equal.all(), t.name
        assert total == 0 or same / total > 0.95
