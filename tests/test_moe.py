"""Mixture-of-experts specifics beyond the decoder families' shared tests (test_model_reference.py and
test_native_model.py run the four MoE families too): Qwen's dense layers among the MoE ones, and what `churon
inspect` says of the experts."""

import pytest
import torch

from churon import kernels
from churon.cli import main
from test_model_reference import compare_prefill_and_decode
from tiny_models import _randomize, make_hf_model, reference_model


@pytest.mark.parametrize("dense", [{"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}], ids=["mlp_only_layers", "sparse_step"])
def test_qwen_dense_layers_among_the_moe_ones(dense, tmp_path):
    """mlp_only_layers [1] (layer 1 dense) and decoder_sparse_step 2 (layer 0 dense: (i + 1) % 2 != 0), against
    transformers on the reference path and the native path against the reference."""
    import transformers

    hf = make_hf_model("qwen3_moe", tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(hf)
    for key, value in dense.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, 1)
    model.save_pretrained(hf)
    compare_prefill_and_decode(hf, reference_model(hf))
    if kernels.native_available():
        from churon.engine.kv_cache import SequenceKVCache
        from churon.loader import load_model

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
