"""Mixture-of-experts specifics beyond the decoder families' shared tests (test_model_reference.py and
test_native_model.py run the four MoE families too): Qwen's dense layers among the MoE ones, what `churon
inspect` says of the experts, LoRA adapters on MoE models (the attention's modules applied, the experts'
refused by name), and `churon quantize` on them (rtn, loaded by churon and llama.cpp; the calibrating methods
refused by name)."""

import gguf
import numpy as np
import pytest
import torch

from churon import kernels
from churon.cli import main
from churon.engine.kv_cache import SequenceKVCache
from churon.errors import ModelFileError
from churon.formats.hf import HFModel
from churon.formats.lora import read_lora
from churon.loader import load_model
from test_lora_formats import _gguf_adapter, copy_adapter
from llama_cpp_peer import llama_cpp_logits
from test_lora_model import ATTENTION, compare_with_reference, with_adapters
from test_model_reference import compare_prefill_and_decode
from tiny_models import (
    EXPERT_INTERMEDIATE,
    HIDDEN,
    INTERMEDIATE,
    MOE_ARCHS,
    N_EXPERTS,
    _randomize,
    make_hf_model,
    make_peft_adapter,
    peft_model,
    reference_model,
    write_gguf,
)


def qwen_moe_with_dense_layers(out_dir, **dense):
    """The tiny Qwen3-MoE with Qwen's dense-layer fields (mlp_only_layers, decoder_sparse_step) set, saved in out_dir."""
    import transformers

    hf = make_hf_model("qwen3_moe", out_dir)
    config = transformers.AutoConfig.from_pretrained(hf)
    for key, value in dense.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, 1)
    model.save_pretrained(hf)
    return hf


@pytest.mark.parametrize("dense", [{"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}], ids=["mlp_only_layers", "sparse_step"])
def test_qwen_dense_layers_among_the_moe_ones(dense, tmp_path):
    """mlp_only_layers [1] (layer 1 dense) and decoder_sparse_step 2 (layer 0 dense: (i + 1) % 2 != 0), against
    transformers on the reference path and the native path against the reference."""
    hf = qwen_moe_with_dense_layers(tmp_path / "hf", **dense)
    compare_prefill_and_decode(hf, reference_model(hf))
    if kernels.native_available():

        native, _, _ = load_model(hf, kernels="native")
        reference, _, _ = load_model(hf, kernels="reference")
        assert native.config.dense_layers == ((1,) if "mlp_only_layers" in dense else (0,))
        tokens = torch.tensor([5, 17, 42, 99, 3, 250, 7])
        want = reference(tokens, 0, SequenceKVCache.for_model(reference, 16), all_logits=True)
        got = native(tokens, 0, SequenceKVCache(native.config, 16, dtype=torch.float32), all_logits=True)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_inspect_reports_the_experts(tmp_path, capsys):
    hf = make_hf_model("qwen2_moe", tmp_path / "hf")
    assert main(["inspect", str(hf)]) == 0
    out = capsys.readouterr().out
    assert "experts            8 of FFN 32, 2 active per token, a shared expert of FFN 48" in out
    # 168,640 in all; a token skips 6 of the 8 experts' gate, up and down (64 x 32 each) on both layers
    assert f"active parameters  {168_640 - 2 * 6 * 3 * 64 * 32:,} (0.1 M) of 168,640 per token" in out


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_an_attention_adapter_on_an_moe_model_gives_peft_s_logits(arch, tmp_path):
    """PEFT names the base model by its model_type (qwen3_moe), churon by its architecture (qwen3moe): the same model."""
    hf = make_hf_model(arch, tmp_path / "hf")
    adapter = make_peft_adapter(hf, tmp_path / "adapter", targets=ATTENTION)
    compare_with_reference(with_adapters(hf, [adapter]), peft_model(hf, adapter))


A, B_HIDDEN = np.zeros((4, HIDDEN), np.float32), np.zeros((HIDDEN, 4), np.float32)


def _refused_adapters(hf, tmp_path):
    """id -> (an adapter on the experts of the model in hf, the message naming what it adapts)."""
    attention = make_peft_adapter(hf, tmp_path / "attention", targets=ATTENTION)
    gate = "base_model.model.model.layers.0.mlp.gate_proj"
    # a dense model's MLP modules on an MoE layer (an adapter made for a dense sibling): shaped as the model's
    # intermediate_size says, so only the layer's routing tells them apart from a dense layer's
    mlp_on_moe_layer = copy_adapter(
        attention, tmp_path / "mlp", config={"target_modules": list(ATTENTION) + ["gate_proj"]},
        tensors=lambda ts: ts | {f"{gate}.lora_A.weight": torch.zeros(4, HIDDEN),
                                 f"{gate}.lora_B.weight": torch.zeros(INTERMEDIATE, 4)})
    gguf_args = dict(arch="qwen3moe")
    return {
        "peft-mlp-of-an-moe-layer": (mlp_on_moe_layer, r"tensor '.*layers\.0\.mlp\.gate_proj\.lora_A\.weight' adapts"
                                     r" layers\.0\.mlp\.gate_proj, but layer 0's MLP is 8 routed experts"),
        "gguf-mlp-of-an-moe-layer": (
            _gguf_adapter(tmp_path / "down.gguf", {"blk.1.ffn_down.weight.lora_a": np.zeros((4, INTERMEDIATE), np.float32),
                                                   "blk.1.ffn_down.weight.lora_b": B_HIDDEN}, **gguf_args),
            r"tensor 'blk\.1\.ffn_down\.weight\.lora_a' adapts layers\.1\.mlp\.down_proj, but layer 1's MLP is 8 routed"),
        "gguf-stacked-experts": (
            _gguf_adapter(tmp_path / "exps.gguf", {"blk.0.ffn_gate_exps.weight.lora_a": A,
                                                   "blk.0.ffn_gate_exps.weight.lora_b": np.zeros((EXPERT_INTERMEDIATE, 4),
                                                                                                 np.float32)}, **gguf_args),
            r"tensor 'blk\.0\.ffn_gate_exps\.weight\.lora_a' adapts 'blk\.0\.ffn_gate_exps\.weight', a mixture-of-experts"
            r" layer's router or experts"),
        "gguf-router": (
            _gguf_adapter(tmp_path / "router.gguf", {"blk.0.ffn_gate_inp.weight.lora_a": A,
                                                     "blk.0.ffn_gate_inp.weight.lora_b": np.zeros((N_EXPERTS, 4), np.float32)},
                          **gguf_args),
            r"adapts 'blk\.0\.ffn_gate_inp\.weight', a mixture-of-experts layer's router or experts"),
    }


REFUSED = ("peft-mlp-of-an-moe-layer", "gguf-mlp-of-an-moe-layer", "gguf-stacked-experts", "gguf-router")


@pytest.mark.parametrize("name", REFUSED)
def test_an_adapter_on_the_experts_is_refused_naming_the_module(name, tmp_path):
    """Read for the model, and read alone then loaded into its slots: the MoE layer's MLP would otherwise run
    without the adapter's delta, silently."""
    hf = make_hf_model("qwen3_moe", tmp_path / "hf")
    path, match = _refused_adapters(hf, tmp_path)[name]
    model = with_adapters(hf, [])
    with pytest.raises(ModelFileError, match=match):
        read_lora(path, model.config)
    with pytest.raises(ModelFileError, match=match):
        model.lora.load(0, read_lora(path))


def test_a_shared_expert_s_adapter_is_refused_naming_the_module(tmp_path):
    """Qwen2-MoE's shared expert is a gate/up/down MLP PEFT targets by those names."""
    hf = make_hf_model("qwen2_moe", tmp_path / "hf")
    adapter = make_peft_adapter(hf, tmp_path / "adapter")
    with pytest.raises(ModelFileError, match=r"adapts 'model\.layers\.0\.mlp\.shared_expert\.down_proj', a mixture-of-experts"
                                             r" layer's router or experts"):
        read_lora(adapter, HFModel(hf).config)


def test_a_dense_layer_s_mlp_adapter_on_an_moe_model_is_applied(tmp_path):
    """Layer 1 dense (mlp_only_layers): its MLP takes an adapter as a dense model's does, layer 0's refuses it."""
    hf = qwen_moe_with_dense_layers(tmp_path / "hf", mlp_only_layers=[1])
    config = HFModel(hf).config
    g = torch.Generator().manual_seed(0)
    for layer, refused in ((0, True), (1, False)):
        pair = {f"blk.{layer}.ffn_up.weight.lora_a": torch.randn(4, HIDDEN, generator=g).numpy(),
                f"blk.{layer}.ffn_up.weight.lora_b": torch.randn(INTERMEDIATE, 4, generator=g).numpy()}
        path = _gguf_adapter(tmp_path / f"up{layer}.gguf", pair, arch="qwen3moe")
        if refused:
            with pytest.raises(ModelFileError, match=r"layer 0's MLP is 8 routed experts"):
                read_lora(path, config)
            continue
        model = with_adapters(hf, [path])
        tokens = torch.tensor([5, 17, 42, 99, 3])
        base = model(tokens, 0, SequenceKVCache.for_model(model, 8), all_logits=True)
        adapted = model(tokens, 0, SequenceKVCache.for_model(model, 8), all_logits=True, lora_slot=0)
        assert not torch.equal(base, adapted)  # the delta reaches the logits


# --- churon quantize on MoE models


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """The tiny Qwen3-MoE as an F32 GGUF (churon requantizes an MoE GGUF; it writes no MoE directory as one)."""
    tmp = tmp_path_factory.mktemp("moe-gguf")
    return write_gguf(make_hf_model("qwen3_moe", tmp / "hf"), tmp / "f32.gguf", "F32")


@pytest.mark.parametrize("args", [["--method", "imatrix"], ["--method", "awq"], ["--method", "gptq"],
                                  ["--target-bpw", "6"]], ids=["imatrix", "awq", "gptq", "target-bpw"])
def test_calibrating_an_moe_model_is_refused_naming_the_method_and_experts(moe_gguf, tmp_path, capsys, args):
    out = tmp_path / "out.gguf"
    assert main(["quantize", str(moe_gguf), str(out), "--type", "Q4_0", "-q", *args]) == 1
    needs = f"method '{args[1]}'" if args[0] == "--method" else "--target-bpw"
    assert (f"{needs} calibrates on the inputs of every linear layer, which churon does not gather for a"
            " mixture-of-experts model's routed experts (8 per MoE layer, 2 active per token); quantize it with"
            " method 'rtn' and no --target-bpw") in capsys.readouterr().err
    assert not out.exists()


def test_rtn_requantizes_an_moe_gguf_that_churon_and_llama_cpp_load(moe_gguf, tmp_path):
    """The stacked experts [experts, rows, cols] rounded as rows of blocks: churon's logits on the Q4_0 file stay as near
    the F32 source's as 4-bit rounding lets them, and llama.cpp's on the same file far nearer churon's than the rounding moved them (its 8-bit
    activations, see test_quantize_cli.py)."""
    out = tmp_path / "q4_0.gguf"
    assert main(["quantize", str(moe_gguf), str(out), "--type", "Q4_0", "-q"]) == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert {types[f"blk.{i}.ffn_{m}_exps.weight"] for i in range(2) for m in ("gate", "up", "down")} == {"Q4_0"}
    tokens = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 8]
    source, _, _ = load_model(moe_gguf, kernels="reference")
    quantized, _, _ = load_model(out, kernels="reference")
    want = source(torch.tensor(tokens), 0, SequenceKVCache.for_model(source, 16), all_logits=True)
    ours = quantized(torch.tensor(tokens), 0, SequenceKVCache.for_model(quantized, 16), all_logits=True)
    theirs = llama_cpp_logits(out, tokens)
    moved = float((ours - want).norm())
    # 4-bit rounding moves this random model's logits by ~40% of their norm; experts swapped or misread by ~140%
    assert moved < 0.6 * float(want.norm())
    assert float((theirs - ours).norm()) < 0.15 * moved
