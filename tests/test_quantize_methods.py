"""Calibration statistics and the calibrated quantization methods (imatrix, GPTQ, AWQ) on tiny models.

Each method is judged by what it optimizes: the output error of a linear layer over calibration
inputs, ||X W^T - X Wq^T||^2 = tr(D H D^T) with D = W - Wq and H = X^T X.
"""

import weakref

import numpy as np
import pytest
import torch

from churon.formats.gguf import GGUFModel, canonical_name
from churon.formats.hf import HFModel
from churon.tokenizer import load_tokenizer
from churon.formats.quants import dequantize, quant_type, quantize
from churon.model.reference_backend import ReferenceBackend
from churon.model.transformer import Transformer
from churon.quantize.awq import AWQMethod, output_error, search_scales
from churon.quantize.calibration import ActivationStats, collect_stats
from churon.quantize import gptq
from churon.quantize.gptq import (
    CODE_BYTES, GPTQMethod, block_grid, gptq_quantize, inverse_hessian_factor, write_codes,
)
from churon.quantize.imatrix import ImatrixMethod
from churon.quantize.pipeline import quantize_model
from churon.quantize.source import SourceTensors
from churon.engine.kv_cache import SequenceKVCache
from tiny_models import make_hf_model, reference_model, unpermute_qk, write_gguf

WINDOWS = [list(range(3, 67)), [(7 * i) % 300 + 3 for i in range(64)], [(13 * i + 5) % 350 + 3 for i in range(48)]]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_hf_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama_stats(llama_dir):
    return collect_stats(HFModel(llama_dir), WINDOWS, hessian=True, progress=False)


def dq(raw, qtype, shape):
    return dequantize(raw, quant_type(qtype), shape)


def reference_inputs(model, modules: dict) -> dict[str, torch.Tensor]:
    """name -> the input rows (float64, all WINDOWS in order) transformers' module receives in model's forward."""
    seen = {name: [] for name in modules}
    hooks = [m.register_forward_pre_hook(lambda _, args, name=name: seen[name].append(args[0][0].clone()))
             for name, m in modules.items()]
    with torch.no_grad():
        for window in WINDOWS:
            model(torch.tensor([window]))
    for h in hooks:
        h.remove()
    return {name: torch.cat(inputs).double() for name, inputs in seen.items()}


def test_stats_match_the_inputs_of_a_reference_forward(llama_dir, llama_stats):
    """sum x^2, sum |x| and sum x x^T of the inputs transformers' modules receive, window by window."""
    model = reference_model(llama_dir)
    layer = model.model.layers[1]
    modules = {"blk.1.attn_q.weight": layer.self_attn.q_proj, "blk.1.attn_output.weight": layer.self_attn.o_proj,
               "blk.1.ffn_up.weight": layer.mlp.up_proj, "blk.1.ffn_down.weight": layer.mlp.down_proj}
    for name, x in reference_inputs(model, modules).items():
        s = llama_stats[name]
        assert s.count == sum(len(w) for w in WINDOWS) == x.shape[0]
        torch.testing.assert_close(s.sum_sq, x.square().sum(0), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(s.sum_abs, x.abs().sum(0), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(s.hessian, x.T @ x, rtol=1e-4, atol=1e-5)
    # inputs shared by several weights share one ActivationStats
    assert llama_stats["blk.1.attn_q.weight"] is llama_stats["blk.1.attn_k.weight"] is llama_stats["blk.1.attn_v.weight"]
    assert llama_stats["blk.1.ffn_gate.weight"] is llama_stats["blk.1.ffn_up.weight"]
    assert llama_stats["token_embd.weight"].count == llama_stats["blk.0.attn_q.weight"].count  # tied logits


@pytest.mark.parametrize("arch,fmt", [("llama", "gguf"), ("qwen2", "gguf"), ("qwen3", "hf"), ("gemma3", "gguf")])
def test_layerwise_stats_match_a_reference_forward_at_every_layer(tmp_path, arch, fmt):
    """Calibration carries the windows' hidden states from block to block (one block's weights at a time);
    every layer's inputs, and the output matrix's, are those of transformers' whole-model forward.
    llama from GGUF: q/k rows in llama.cpp's layout; qwen2: q/k/v biases; qwen3: q/k norms, untied output;
    gemma3: the norms after attention and the MLP (the latter applied by calibration itself), scaled embeddings."""
    hf = make_hf_model(arch, tmp_path / "hf", tie_word_embeddings=arch != "qwen3")
    source = GGUFModel(write_gguf(hf, tmp_path / "m.gguf", "F32")) if fmt == "gguf" else HFModel(hf)
    stats = collect_stats(source, WINDOWS, hessian=True, progress=False)
    model = reference_model(hf)
    modules = {}
    for i, layer in enumerate(model.model.layers):
        modules |= {f"blk.{i}.attn_q.weight": layer.self_attn.q_proj, f"blk.{i}.attn_output.weight": layer.self_attn.o_proj,
                    f"blk.{i}.ffn_up.weight": layer.mlp.up_proj, f"blk.{i}.ffn_down.weight": layer.mlp.down_proj}
    modules["token_embd.weight" if arch != "qwen3" else "output.weight"] = model.lm_head
    assert len(stats) == 7 * source.config.num_layers + 1
    for name, x in reference_inputs(model, modules).items():
        assert stats[name].count == x.shape[0], name
        torch.testing.assert_close(stats[name].sum_sq, x.square().sum(0), rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(stats[name].hessian, x.T @ x, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantize_holds_one_block_at_a_time(tmp_path, llama_dir, monkeypatch, method):
    """Reading any weight matrix, no matrix of another block is alive; creating any Hessian, no Hessian of
    an earlier block is (calibration and quantization go block by block, never the whole model)."""
    alive: list[tuple[str, weakref.ref]] = []

    def group(name):
        return name.split(".")[1] if name.startswith("blk.") else "outside the blocks"

    def tracked(read):
        def wrapper(self, name):
            out = read(self, name)
            w = out[1] if isinstance(out, tuple) else out
            others = {g for g, ref in alive if ref() is not None} - {group(name)}
            assert not others, f"reading {name} while weights of {others} are alive"
            if w.dim() == 2:
                alive.append((group(name), weakref.ref(w)))
            return out
        return wrapper

    monkeypatch.setattr(SourceTensors, "read", tracked(SourceTensors.read))
    monkeypatch.setattr(SourceTensors, "read_canonical", tracked(SourceTensors.read_canonical))
    hessians: list[weakref.ref] = []
    empty = ActivationStats.empty.__func__

    def tracked_empty(cls, cols, hessian):
        stats = empty(cls, cols, hessian)
        block_start = len(hessians) // 4 * 4  # four distinct inputs per block: qkv, o, gate_up, down
        assert all(ref() is None for ref in hessians[:block_start]), "an earlier block's Hessian is alive"
        hessians.append(weakref.ref(stats))
        return stats

    monkeypatch.setattr(ActivationStats, "empty", classmethod(tracked_empty))
    hf = make_hf_model("llama", tmp_path / "hf", seed=3)
    text = "The quick brown fox jumps over the lazy dog. " * 60
    quantize_model(hf, tmp_path / "q.gguf", "Q4_0", method=method, calib_text=text, progress=False)
    n_layers = HFModel(hf).config.num_layers
    assert len(hessians) == 4 * n_layers + 1 and len({g for g, _ in alive}) == n_layers + 1


def test_collect_stats_from_text_cuts_windows(llama_dir):
    text = "The quick brown fox jumps over the lazy dog. " * 30
    stats = collect_stats(HFModel(llama_dir), text, hessian=False, progress=False, ctx=32)
    tokens = load_tokenizer(HFModel(llama_dir)).encode(text, add_bos=False)
    assert stats["blk.0.attn_q.weight"].count == len(tokens) // 32 * 32
    assert stats["blk.0.attn_q.weight"].hessian is None
    with pytest.raises(ValueError, match="fewer than one window"):
        collect_stats(HFModel(llama_dir), "too short", hessian=False, progress=False, ctx=32)
    # the default window (512) is cut to the tiny model's context
    ctx = HFModel(llama_dir).config.context_length
    assert ctx < 512
    stats = collect_stats(HFModel(llama_dir), text * 3, hessian=False, progress=False)
    assert stats["blk.0.attn_q.weight"].count == (3 * len(tokens)) // ctx * ctx


def _layer_error(stats: ActivationStats, weight: torch.Tensor, quantized: torch.Tensor) -> float:
    return output_error(weight, quantized, stats.hessian)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0"])
def test_imatrix_lowers_the_calibration_output_error(llama_dir, llama_stats, qtype):
    weights = HFModel(llama_dir).load_weights()
    for name, canonical in [("blk.1.ffn_down.weight", "layers.1.mlp.down_proj.weight"),
                            ("blk.0.attn_q.weight", "layers.0.self_attn.q_proj.weight")]:
        w, s = weights[canonical], llama_stats[name]
        rtn = _layer_error(s, w, dq(quantize(w, qtype), qtype, w.shape))
        imatrix = _layer_error(s, w, dq(ImatrixMethod().quantize(name, w, qtype, s), qtype, w.shape))
        assert imatrix < rtn


def _correlated_inputs(n: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Inputs with strongly correlated columns of very different scales, like real activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) * 0.3 + torch.eye(cols)
    scale = torch.exp(torch.randn(cols, generator=g))
    return (torch.randn(n, cols, generator=g) @ mix) * scale


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
def test_gptq_beats_rtn_and_imatrix_on_correlated_inputs(qtype):
    """In-sample: the error on the very inputs whose Hessian GPTQ compensates with."""
    cols = 256 if qtype.endswith("K") else 64
    x = _correlated_inputs(1024, cols)
    w = torch.randn(48, cols, generator=torch.Generator().manual_seed(1)) * 0.1
    stats = ActivationStats.empty(cols, hessian=True)
    stats.add(x)
    rtn = _layer_error(stats, w, dq(quantize(w, qtype), qtype, w.shape))
    imatrix = _layer_error(stats, w, dq(quantize(w, qtype, importance=stats.mean_sq.float()), qtype, w.shape))
    gptq = _layer_error(stats, w, dq(GPTQMethod().quantize("w", w, qtype, stats), qtype, w.shape))
    assert gptq < imatrix < rtn
    # on the inputs it was fitted to, lightly damped GPTQ compensates much more (and overfits on other inputs)
    light = _layer_error(stats, w, dq(gptq_quantize(w, qtype, stats.hessian, damp=0.01), qtype, w.shape))
    assert light < 0.8 * imatrix


def test_gptq_on_a_tiny_models_layer(llama_dir, llama_stats):
    w = HFModel(llama_dir).load_weights()["layers.1.mlp.down_proj.weight"]
    s = llama_stats["blk.1.ffn_down.weight"]
    rtn = _layer_error(s, w, dq(quantize(w, "Q4_0"), "Q4_0", w.shape))
    assert _layer_error(s, w, dq(gptq_quantize(w, "Q4_0", s.hessian), "Q4_0", w.shape)) < rtn


@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
def test_gptq_works_on_rows_a_chunk_at_a_time(monkeypatch, qtype):
    """Each row compensates only its own error: chunks of rows (7 here, not dividing 48) give the same bytes."""
    cols = 256
    stats = ActivationStats.empty(cols, hessian=True)
    stats.add(_correlated_inputs(512, cols))
    w = torch.randn(48, cols, generator=torch.Generator().manual_seed(2)) * 0.1
    whole = gptq_quantize(w, qtype, stats.hessian)
    monkeypatch.setattr(gptq, "ROW_CHUNK_VALUES", 7 * cols)
    chunked = gptq_quantize(w, qtype, stats.hessian)
    assert whole.shape == chunked.shape
    np.testing.assert_array_equal(chunked, whole)


def test_gptq_leaves_float_types_alone_and_checks_block_width():
    w = torch.randn(4, 64)
    h = torch.eye(64, dtype=torch.float64)
    assert (gptq_quantize(w, "F16", h) == quantize(w, "F16")).all()
    with pytest.raises(ValueError, match="not a multiple"):
        gptq_quantize(torch.randn(4, 96), "Q4_K", torch.eye(96, dtype=torch.float64))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_block_codes_are_read_and_written_without_touching_the_scales(qtype):
    """GPTQ rounds onto a block's grid (offset + step * code) and writes the codes back into the block."""
    t = quant_type(qtype)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(5))
    raw = quantize(x, t)
    offset, step = block_grid(raw, t, (4, 512))
    lo, hi = CODE_BYTES[t][2:]
    own_codes = ((dq(raw, qtype, x.shape).double() - offset) / step).round()
    assert (write_codes(raw, t, own_codes) == raw).all()  # the block's own codes give back its bytes
    codes = torch.randint(lo, hi + 1, (4, 512), generator=torch.Generator().manual_seed(6)).float()
    torch.testing.assert_close(dq(write_codes(raw, t, codes), qtype, x.shape).double(), offset + step * codes,
                               rtol=0, atol=1e-6)


def test_inverse_hessian_factor_is_the_cholesky_of_the_damped_inverse():
    x = _correlated_inputs(200, 16)
    h = (x.T @ x).double()
    h[3, :] = h[:, 3] = 0  # a column no input touched
    u = inverse_hessian_factor(h, damp=0.01)
    damped = h.clone()
    damped[3, 3] = 1.0
    damped.diagonal().add_(0.01 * damped.diagonal().mean())
    torch.testing.assert_close(u.T @ u, torch.linalg.inv(damped))
    assert torch.equal(u, u.triu())


def test_awq_scale_search_lowers_the_error_below_rtn(llama_dir, llama_stats):
    weights = HFModel(llama_dir).load_weights()
    s = llama_stats["blk.1.attn_q.weight"]
    ws = [weights[f"layers.1.self_attn.{x}_proj.weight"] for x in "qkv"]
    scales, alpha = search_scales(ws, ["Q4_0"] * 3, s)
    rtn = sum(_layer_error(s, w, dq(quantize(w, "Q4_0"), "Q4_0", w.shape)) for w in ws)
    imp = (s.mean_sq / scales.double().square()).float()
    awq = sum(_layer_error(s, w, dq(quantize(w * scales, "Q4_0", importance=imp), "Q4_0", w.shape) / scales) for w in ws)
    assert awq < rtn
    assert 0.0 <= alpha <= 1.0 and scales.shape == (ws[0].shape[1],)


def test_awq_scales_search_on_correlated_inputs_picks_a_scale():
    """Inputs with a few huge channels: AWQ's scaled quantization must beat the unscaled one."""
    cols = 64
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2048, cols, generator=g)
    x[:, :4] *= 30.0  # outlier channels
    w = torch.randn(32, cols, generator=g) * 0.1
    stats = ActivationStats.empty(cols, hessian=True)
    stats.add(x)
    scales, alpha = search_scales([w], ["Q4_0"], stats)
    assert alpha > 0
    unscaled = _layer_error(stats, w, dq(quantize(w, "Q4_0", importance=stats.mean_sq.float()), "Q4_0", w.shape))
    imp = (stats.mean_sq / scales.double().square()).float()
    scaled = _layer_error(stats, w, dq(quantize(w * scales, "Q4_0", importance=imp), "Q4_0", w.shape) / scales)
    assert scaled < unscaled


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_awq_transform_keeps_the_float_model(tmp_path, llama_dir, arch):
    """Folding the scales into norms and up rows is exact: the transformed float model's logits match.
    llama: q/k rows in llama.cpp's permuted layout; qwen2: q/k/v biases."""
    hf = llama_dir if arch == "llama" else make_hf_model(arch, tmp_path / "hf")
    gguf_path = write_gguf(hf, tmp_path / "m.gguf", "F32")
    source = GGUFModel(gguf_path)
    stats = collect_stats(source, WINDOWS, hessian=True, progress=False)
    tensors = {n: dequantize(t.data, t.qtype, t.shape) for n, t in source.file.tensors.items()}
    awq = AWQMethod()
    for i in range(source.config.num_layers):
        block = {n: w for n, w in tensors.items() if n.startswith(f"blk.{i}.")}
        qtypes = {n: "Q4_0" if w.dim() == 2 else "F32" for n, w in block.items()}
        transformed = awq.transform(block, stats, qtypes)
        assert set(transformed) == set(block)
        assert not torch.equal(transformed[f"blk.{i}.attn_q.weight"], block[f"blk.{i}.attn_q.weight"])
        tensors.update(transformed)
    assert set(awq.alphas) and set(awq.scales) >= {"blk.0.attn_q.weight", "blk.1.ffn_down.weight"}
    # back to churon's weights: the transformed tensors in place of the file's (q/k rows un-permuted as the loader does)
    original = source.load_weights()
    canonical = {canonical_name(n): n for n in tensors}
    weights = {}
    for name, raw in original.items():
        w = tensors[canonical[name]]
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = source.config.num_heads if ".q_proj." in name else source.config.num_kv_heads
            w = unpermute_qk(w, heads)
        weights[name] = w
    before = Transformer(source.config, original, ReferenceBackend())
    after = Transformer(source.config, weights, ReferenceBackend())
    ids = torch.tensor(WINDOWS[1])
    a = before(ids, 0, SequenceKVCache.for_model(before, len(ids)), all_logits=True)
    b = after(ids, 0, SequenceKVCache.for_model(after, len(ids)), all_logits=True)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_awq_needs_the_hessian_and_the_types():
    stats = ActivationStats.empty(64, hessian=False)
    stats.add(torch.randn(10, 64))
    with pytest.raises(ValueError, match="Hessian"):
        search_scales([torch.randn(8, 64)], ["Q4_0"], stats)
    with pytest.raises(ValueError, match="qtypes"):
        AWQMethod().transform({"blk.0.attn_q.weight": torch.randn(8, 64)}, {})


def test_the_default_calibration_text_ships_with_churon(llama_dir):
    from churon.quantize.calibration import calibration_windows
    from churon.quantize.pipeline import default_calibration_text

    text = default_calibration_text()
    assert len(text.encode()) > 30_000
    assert "def " in text and "SELECT" in text and "1,048,576" in text  # prose, code and numbers
    assert len(calibration_windows(HFModel(llama_dir), text, ctx=256)) > 20
