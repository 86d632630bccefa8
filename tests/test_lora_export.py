"""churon export: a LoRA adapter merged into a model's weights and written as a GGUF of any type and method,
or written alone as a llama.cpp GGUF adapter; churon quantize on the directory PEFT's merge_and_unload writes.

The reference is PEFT: the transformers model with the adapter attached, unmerged (y = W x + s * B A x).
churon's logits on an exported file come from the reference kernels, so a difference is the export's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import tiny_models
from churon import LLM, SamplingParams
from churon.cli import main
from churon.engine.kv_cache import SequenceKVCache
from churon.errors import UnsupportedModelError
from churon.formats.gguf import GGUFModel
from churon.formats.hf import HFModel
from churon.formats.lora import LoraAdapter, LoraModule, read_lora, write_lora_gguf
from churon.quantize import quantize_model
from llama_cpp_peer import llama_cpp_greedy, llama_cpp_logits
from tiny_models import make_hf_model, make_peft_adapter, peft_model, reference_model, write_gguf

PROMPT = "The quick brown fox jumps over the lazy dog"
CALIB_TEXT = tiny_models.TRAINING_TEXT * 2  # one window of the tiny models' 256 positions
F32_TOLERANCE = 1e-4
# Q8_0 moves these tiny random models' logits by 3-5% (max error over max logit; measured: base and merged
# alike): a merged Q8_0 model may be off by what Q8_0 does to the base model, with some margin
Q8_0_MARGIN = 1.5

# llama: q/k rows travel permuted in GGUF (weights and lora_b); qwen2: biases on q/k/v, rsLoRA and per-module
# ranks and alphas (each module its own scaling)
ADAPTERS = {
    "llama": dict(rank=4, alpha=8.0),
    "qwen2": dict(rank=8, alpha=4.0, use_rslora=True, rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 12.0}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (HF directory, PEFT adapter directory for it)."""
    out = {}
    for arch, kwargs in ADAPTERS.items():
        hf = make_hf_model(arch, tmp_path_factory.mktemp(f"base-{arch}"), tie_word_embeddings=arch == "llama")
        out[arch] = hf, make_peft_adapter(hf, tmp_path_factory.mktemp(f"lora-{arch}"), seed=1, **kwargs)
    return out


def churon_logits(path: Path, ids: list[int]) -> torch.Tensor:
    llm = LLM(path, threads=1, kernels="reference")
    return llm.model(torch.tensor(ids), 0, SequenceKVCache.for_model(llm.model, len(ids)), all_logits=True)


def prompt_ids(hf: Path) -> list[int]:
    return LLM(hf, threads=1, kernels="reference").tokenizer.encode(PROMPT)


@torch.no_grad()
def peft_logits(hf: Path, adapter: Path, ids: list[int], gguf_path: Path | None = None,
                scale: float = 1.0) -> torch.Tensor:
    from peft.tuners.lora import LoraLayer

    model = peft_model(hf, adapter, gguf_path)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.scale_layer(scale)  # what merge_and_unload would merge, times scale
    return model(torch.tensor([ids])).logits[0]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@torch.no_grad()
def q8_0_tolerance(hf: Path, ids: list[int], tmp_path: Path) -> float:
    """What rounding to Q8_0 does to the base model's logits, times the margin."""
    base_q8 = write_gguf(hf, tmp_path / "base-q8.gguf", "Q8_0")
    return Q8_0_MARGIN * relative_error(churon_logits(base_q8, ids), reference_model(hf)(torch.tensor([ids])).logits[0])


def export(*argv) -> None:
    assert main(["export", *map(str, argv), "-q"]) == 0


def merged_directory(hf: Path, adapter: Path, out: Path) -> Path:
    """What a PEFT user deploys: merge_and_unload + save_pretrained, with the base model's tokenizer files."""
    peft_model(hf, adapter).merge_and_unload().save_pretrained(out)
    for f in hf.iterdir():
        if not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, np.array(t.data)) for t in gguf.GGUFReader(path).tensors}


# --- merged export, F32: exactly the unmerged model


@pytest.mark.parametrize("arch", list(ADAPTERS))
@pytest.mark.parametrize("base", ["hf", "gguf"])
def test_f32_export_equals_the_unmerged_adapter(models, tmp_path, arch, base):
    """W' = W + s * B @ A for every target: the exported F32 model computes what PEFT's unmerged adapter does.
    A GGUF base (Q8_0 here) is merged into its dequantized weights, llama's q/k deltas permuted like its rows."""
    hf, adapter = models[arch]
    src, base_weights = hf, None
    if base == "gguf":
        src = base_weights = write_gguf(hf, tmp_path / "base.gguf", "Q8_0")
    export(src, "--lora", adapter, tmp_path / "merged.gguf", "--type", "F32")
    ids = prompt_ids(hf)
    want = peft_logits(hf, adapter, ids, base_weights)
    assert relative_error(churon_logits(tmp_path / "merged.gguf", ids), want) < F32_TOLERANCE
    # not vacuous: the adapter moves the logits far more than the tolerance
    unmerged = churon_logits(base_weights or write_gguf(hf, tmp_path / "base-f32.gguf", "F32"), ids)
    assert relative_error(unmerged, want) > 1000 * F32_TOLERANCE


@pytest.mark.parametrize("arch", list(ADAPTERS))
def test_scale_multiplies_the_adapter(models, tmp_path, arch):
    hf, adapter = models[arch]
    export(hf, "--lora", adapter, "--scale", 0.5, tmp_path / "half.gguf", "--type", "F32")
    ids = prompt_ids(hf)
    assert relative_error(churon_logits(tmp_path / "half.gguf", ids), peft_logits(hf, adapter, ids, scale=0.5)) \
        < F32_TOLERANCE


@pytest.mark.parametrize("arch", list(ADAPTERS))
def test_f32_export_generates_what_churon_unmerged_does(models, tmp_path, arch):
    """churon's own unmerged path (the base model + the adapter loaded, reference kernels) and the merged export
    choose the same greedy tokens with the same log-probabilities, the scale taken as the request's lora_scale."""
    hf, adapter = models[arch]
    export(hf, "--lora", adapter, "--scale", 0.5, tmp_path / "merged.gguf", "--type", "F32")
    ids = prompt_ids(hf)
    params = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    unmerged = LLM(hf, threads=1, kernels="reference", lora_adapters={"tuned": adapter}).generate(
        [ids], SamplingParams(lora="tuned", lora_scale=0.5, **params))[0]
    merged = LLM(tmp_path / "merged.gguf", threads=1, kernels="reference").generate([ids], SamplingParams(**params))[0]
    assert merged.token_ids == unmerged.token_ids
    for a, b in zip(merged.logprobs, unmerged.logprobs):  # the top 5's values (their order may swap a near-tie)
        np.testing.assert_allclose([a.logprob] + [v for _, v in a.top], [b.logprob] + [v for _, v in b.top],
                                   rtol=1e-4, atol=1e-5)


# --- the adapter alone, as llama.cpp's GGUF adapter


@pytest.mark.parametrize("arch", list(ADAPTERS))
def test_adapter_export_round_trips(models, tmp_path, arch):
    """--adapter writes the adapter as llama.cpp's GGUF adapter; read back, and merged from that file, it is
    the PEFT adapter again (llama's q/k lora_b rows permuted on the way out and back)."""
    hf, adapter = models[arch]
    out = tmp_path / "adapter.gguf"
    export(hf, "--lora", adapter, "--adapter", out)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    config = HFModel(hf).config
    peft, ours = read_lora(adapter, config), read_lora(out, config)
    assert ours.kind == "gguf" and sorted(ours.modules) == sorted(peft.modules)
    for name, m in peft.modules.items():
        o = ours.modules[name]
        torch.testing.assert_close(o.scale * o.b @ o.a, m.scale * m.b @ m.a, rtol=1e-6, atol=1e-7, msg=name)
    export(hf, "--lora", out, tmp_path / "merged.gguf", "--type", "F32")
    ids = prompt_ids(hf)
    assert relative_error(churon_logits(tmp_path / "merged.gguf", ids), peft_logits(hf, adapter, ids)) < F32_TOLERANCE


# --- quantized and calibrated exports: the merged model quantized, calibration included


def test_q8_0_export_is_close(models, tmp_path):
    """Q8_0 rounds the merged weights: churon computes what transformers does with the rounded weights, and that
    is as close to PEFT's unmerged model as the rounding allows."""
    hf, adapter = models["llama"]
    out = tmp_path / "merged-q8.gguf"
    export(hf, "--lora", adapter, out, "--type", "Q8_0")
    assert {t for name, (t, _) in tensors(out).items() if name.endswith("attn_q.weight")} == {"Q8_0"}
    ids = prompt_ids(hf)
    got = churon_logits(out, ids)
    merged = merged_directory(hf, adapter, tmp_path / "merged-hf")
    with torch.no_grad():
        assert relative_error(got, reference_model(merged, out)(torch.tensor([ids])).logits[0]) < F32_TOLERANCE
    assert relative_error(got, peft_logits(hf, adapter, ids)) < q8_0_tolerance(hf, ids, tmp_path)


@pytest.mark.parametrize("method, options", [("imatrix", {}), ("awq", {}), ("gptq", {}),
                                             ("rtn", {"target_bpw": 6.0})])
def test_calibrated_export_equals_quantizing_the_merged_model(models, tmp_path, method, options):
    """Calibration and the bit budget see the merged weights: exporting base + adapter gives the very bytes that
    quantizing PEFT's merged directory gives (the merge is PEFT's arithmetic: B @ A, then the scaling)."""
    hf, adapter = models["qwen2"]
    merged = merged_directory(hf, adapter, tmp_path / "merged-hf")
    kwargs = dict(method=method, calib_text=CALIB_TEXT, progress=False, **options)
    ours = quantize_model(hf, tmp_path / "export.gguf", "Q4_0", lora=adapter, **kwargs)
    theirs = quantize_model(merged, tmp_path / "merged.gguf", "Q4_0", **kwargs)
    a, b = tensors(ours.path), tensors(theirs.path)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][0] == b[name][0], name
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=name)
    # and the statistics were not the base model's: its own quantization differs
    base = tensors(quantize_model(hf, tmp_path / "base.gguf", "Q4_0", **kwargs).path)
    assert not np.array_equal(base["blk.0.attn_q.weight"][1], a["blk.0.attn_q.weight"][1])


@pytest.mark.parametrize("arch", list(ADAPTERS))
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_quantize_takes_peft_merged_directory(models, tmp_path, arch, qtype):
    """merge_and_unload + save_pretrained -> churon quantize: the unmerged model's logits, up to the rounding."""
    hf, adapter = models[arch]
    merged = merged_directory(hf, adapter, tmp_path / "merged-hf")
    out = tmp_path / "m.gguf"
    assert main(["quantize", str(merged), str(out), "--type", qtype, "-q"]) == 0
    ids = prompt_ids(hf)
    tolerance = F32_TOLERANCE if qtype == "F32" else q8_0_tolerance(hf, ids, tmp_path)
    assert relative_error(churon_logits(out, ids), peft_logits(hf, adapter, ids)) < tolerance


# --- bad input: a clear error, and no output file


@pytest.fixture(scope="module")
def wide_adapter(tmp_path_factory):
    """A PEFT adapter for a llama of hidden size 128: the wrong shapes for the tiny models."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "HIDDEN", 128)
        mp.setattr(tiny_models, "HEAD_DIM", 32)
        wide = make_hf_model("llama", tmp_path_factory.mktemp("wide"))
        return make_peft_adapter(wide, tmp_path_factory.mktemp("wide-lora"))


def test_mismatched_adapter_is_an_error_before_any_output(models, wide_adapter, tmp_path, capsys):
    hf, adapter = models["llama"]
    qwen_hf, _ = models["qwen2"]
    llama_gguf_adapter = tmp_path / "llama-adapter.gguf"
    export(hf, "--lora", adapter, "--adapter", llama_gguf_adapter)
    capsys.readouterr()
    out = tmp_path / "out.gguf"
    cases = [
        ([hf, "--lora", wide_adapter, out, "--type", "Q8_0"], ["adapter_model.safetensors: tensor 'base_model", "128", "64"]),  # other hidden size
        ([hf, "--lora", wide_adapter, "--adapter", out], ["adapter_model.safetensors: tensor 'base_model"]),
        ([qwen_hf, "--lora", llama_gguf_adapter, out, "--type", "F32"], ["llama", "qwen2"]),  # other architecture
        ([hf, "--lora", hf, out, "--type", "F32"], [str(hf)]),  # a model, not an adapter
        ([hf, "--lora", tmp_path / "missing", out, "--type", "F32"], ["missing"]),
    ]
    for argv, words in cases:
        assert main(["export", *map(str, argv), "-q"]) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("churon: error: ") and all(w in err for w in words), (argv, err)
        assert not out.exists(), argv


def test_encoder_takes_no_adapter(models, tiny_bert_dir, tmp_path):
    with pytest.raises(UnsupportedModelError, match="a LoRA adapter applies to a decoder's linear layers"):
        quantize_model(tiny_bert_dir, tmp_path / "out.gguf", "F32", lora=models["llama"][1], progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--adapter", "A.gguf", "--scale", "0.5"], "--scale: for a merged export"),
    (["--adapter", "A.gguf", "--method", "gptq", "--pure"], "--method, --pure: for a merged export"),
    (["--adapter", "A.gguf", "--type", "Q8_0"], "an adapter is written as F32 or F16"),
    (["OUT"], "--type is required"),
    (["OUT", "--type", "F32", "--scale", "nan"], "--scale must be a finite number"),
    (["OUT", "--type", "F32", "--method", "nope"], "unknown quantization method 'nope'"),
])
def test_export_arguments(models, tmp_path, capsys, argv, message):
    hf, adapter = models["llama"]
    argv = [str(tmp_path / a) if a in ("OUT", "A.gguf") else a for a in argv]
    assert main(["export", str(hf), "--lora", str(adapter), *argv, "-q"]) == 1
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_output_cannot_overwrite_the_adapter(models, tmp_path, capsys):
    hf, adapter = models["llama"]
    a = tmp_path / "adapter.gguf"
    export(hf, "--lora", adapter, "--adapter", a)
    before = a.read_bytes()
    for argv in ([a, "--type", "F32"], ["--adapter", a]):
        assert main(["export", str(hf), "--lora", str(a), *map(str, argv), "-q"]) == 1
        assert "would overwrite the" in capsys.readouterr().err
    assert a.read_bytes() == before


def test_output_cannot_overwrite_the_model(models, tmp_path, capsys):
    hf, adapter = models["llama"]
    base = quantize_model(hf, tmp_path / "base.gguf", "F32", progress=False).path
    before = base.read_bytes()
    for argv in ([base, "--type", "F32"], ["--adapter", base]):  # the adapter alone once wrote over its model
        assert main(["export", str(base), "--lora", str(adapter), *map(str, argv), "-q"]) == 1
        assert "would overwrite the" in capsys.readouterr().err
    assert base.read_bytes() == before


# --- llama.cpp loads what churon exported


def _churon_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    llm = LLM(path, threads=1)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ADAPTERS))
def test_llama_cpp_applies_the_exported_adapter(models, tmp_path, arch):
    """llama.cpp's F32 base model + churon's GGUF adapter, unmerged, computes what churon's merged F32 export
    does: as close as llama.cpp and churon agree on any F32 model (~1e-2), far closer than the adapter moves
    the logits. (The tiny random models' top two logits are often within 1e-2: logits, not greedy tokens.)"""
    hf, adapter = models[arch]
    base = write_gguf(hf, tmp_path / "base.gguf", "F32")
    export(hf, "--lora", adapter, "--adapter", tmp_path / "adapter.gguf")
    export(hf, "--lora", adapter, tmp_path / "merged.gguf", "--type", "F32")
    ids = prompt_ids(hf)
    ours = churon_logits(tmp_path / "merged.gguf", ids)
    assert float((llama_cpp_logits(base, ids, lora=tmp_path / "adapter.gguf") - ours).abs().max()) < 1e-2
    assert float((llama_cpp_logits(base, ids) - ours).abs().max()) > 0.5


def _random_adapter(source: GGUFModel, path: Path, rank: int = 8, std: float = 0.05, seed: int = 0) -> LoraAdapter:
    """A LoRA adapter on every target of every layer of `source`, N(0, std) factors, scale 1."""
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for name, shape in source.weight_shapes().items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in tiny_models.LORA_ALL_TARGETS:
            out_features, in_features = shape
            modules[module] = LoraModule(torch.randn(rank, in_features, generator=g) * std,
                                         torch.randn(out_features, rank, generator=g) * std, 1.0)
    return LoraAdapter(path, "peft", modules, float(rank), False, None, None)


@pytest.mark.slow
def test_llama_cpp_runs_a_quantized_export_of_smollm2(smollm2_gguf, tmp_path):
    """SmolLM2 (Q4_1) + a random rank-8 adapter on all 210 targets, as a GGUF adapter, exported merged at Q8_0:
    llama.cpp's first 8 greedy tokens on that file are churon's. A real model's top two logits lie apart (here
    >= 0.35 at every step) by more than llama.cpp's 8-bit activations move them; a tiny random model's do not,
    and neither do SmolLM2's under a random adapter twice as strong (std 0.1: 0.1 at the first step), where
    llama.cpp's rounding decides. std 0.05 keeps the model fluent and still changes its answer."""
    source = GGUFModel(smollm2_gguf)
    adapter = write_lora_gguf(_random_adapter(source, tmp_path / "random"), source.config, tmp_path / "adapter.gguf")
    out = tmp_path / "merged-q8.gguf"
    export(smollm2_gguf, "--lora", adapter, out, "--type", "Q8_0")
    assert {t for name, (t, _) in tensors(out).items() if name.endswith("attn_q.weight")} == {"Q8_0"}
    prompt = LLM(out, threads=1).tokenizer.encode("The capital of France is")
    ours = _churon_greedy(out, prompt, 8)
    assert llama_cpp_greedy(out, prompt, 8) == ours
    assert ours != _churon_greedy(smollm2_gguf, prompt, 8)  # the adapter changed what the model says
