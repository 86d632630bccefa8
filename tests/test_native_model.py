"""The whole model on the native kernels: close to the reference path, and each token's logits
bit for bit the same whatever else shares its batch, however its prompt is chunked."""

import numpy as np
import pytest
import torch

from churon import kernels
from churon.engine.kv_cache import PagedKVCache, SequenceKVCache
from churon.loader import load_model
from churon.model.batch import ForwardBatch, SequenceChunk
from tiny_models import (
    DECODER_ARCHS,
    LLAMA32_ROPE_SCALING,
    MOE_ARCHS,
    PHI3_LONGROPE,
    SLIDING_WINDOW,
    make_hf_model,
    write_gguf,
)

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason)

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 8, 19, 23, 77, 150, 201, 33]

# Relative to the largest reference logit. Float weights keep float32 activations: only the
# summation order differs. Quantized weights meet 8-bit activations (as in llama.cpp): on these
# tiny random models, whose logits swing with every input, that moves logits by a few percent.
TOLERANCE = {"hf": 1e-4, "F32": 1e-4, "F16": 1e-4, "Q8_0": 0.05, "Q4_0": 0.05, "Q4_1": 0.05}
# An MoE token whose k-th and (k+1)-th experts score within the 8-bit activations' error of each other goes to the other
# one: its logits then move by up to a quarter on these tiny models (float weights, no swap: the 1e-4 above holds)
MOE_QUANTIZED_TOLERANCE = 0.3


@pytest.fixture(scope="module", params=DECODER_ARCHS)
def hf_dir(request, tmp_path_factory):
    return make_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def model_path(hf_dir, qtype, tmp_path):
    if qtype != "hf" and hf_dir.name.startswith("mistral"):
        pytest.skip("convert_hf_to_gguf.py drops Mistral's sliding window (the GGUF is a llama)")
    return hf_dir if qtype == "hf" else write_gguf(hf_dir, tmp_path / f"m-{qtype}.gguf", qtype)


@pytest.mark.parametrize("qtype", list(TOLERANCE))
def test_native_logits_are_close_to_the_reference_path(hf_dir, qtype, tmp_path):
    tolerance = TOLERANCE[qtype]
    if hf_dir.name.startswith(MOE_ARCHS) and qtype.startswith("Q"):
        tolerance = MOE_QUANTIZED_TOLERANCE
    assert_native_close(model_path(hf_dir, qtype, tmp_path), tolerance)


@pytest.mark.parametrize("qtype", ["hf", "Q8_0"])
def test_native_phi3_longrope(qtype, tmp_path):
    """Phi-3's long factors and their attention factor on cos and sin (an original context of 8: the long ones, see
    test_model_reference.py)."""
    hf = make_hf_model("phi3", tmp_path / "hf", rope_scaling={**PHI3_LONGROPE, "original_max_position_embeddings": 8})
    assert_native_close(model_path(hf, qtype, tmp_path), TOLERANCE[qtype])


@pytest.mark.parametrize("qtype", ["hf", "Q8_0"])
def test_native_llama_3_2(qtype, tmp_path):
    """Llama 3.2's shape: llama3 RoPE scaling with its factor 32 and base 500000, tied embeddings, head_dim 64."""
    hf = make_hf_model("llama", tmp_path / "hf", rope_scaling=LLAMA32_ROPE_SCALING, head_dim=64)
    assert_native_close(model_path(hf, qtype, tmp_path), TOLERANCE[qtype])


def test_fused_parts_of_mixed_types_run_as_one_matrix(isa, threads):
    """llama.cpp's Q4_K_M stores a Q6_K v beside Q4_K q and k in half the layers: their fused q/k/v (a RowStack)
    runs as one matrix on the parts' own bytes (a QMatrixStack), not as float32: each part's columns bitwise that
    part's matmul alone (bias split with them) for any number of rows, on every ISA and thread count, a float part
    beside quantized ones included; near the reference's float32 matmul, at the parts' size."""
    from gguf import GGMLQuantizationType as T

    from churon.formats.gguf import GGUFTensor
    from churon.formats.quants import quantize
    from churon.model.native_backend import NativeBackend
    from churon.model.reference_backend import ReferenceBackend
    from churon.model.weights import RowStack, concat_rows

    torch.manual_seed(0)
    # 40 rows: a part ending inside a row group; F16 last: a float part after quantized ones
    shapes = [(T.Q4_K, 64), (T.Q4_K, 40), (T.Q6_K, 32), (T.F16, 24)]
    parts = [GGUFTensor(f"p{i}", (rows, 256), t, quantize(torch.randn(rows, 256), t).reshape(-1))
             for i, (t, rows) in enumerate(shapes)]
    w = concat_rows(parts)
    assert isinstance(w, RowStack) and w.shape == (160, 256)
    native = NativeBackend()
    m = native.matrix(w)
    assert (m.rows, m.cols) == (160, 256)
    assert m.nbytes == sum(native.matrix(p).nbytes for p in parts) < 160 * 256 * 2
    assert m.layout.count(" + ") == 3 and "Q6_K" in m.layout
    bias = torch.randn(160)
    reference = ReferenceBackend()
    ref_w = reference.matrix(w)
    for n_threads in (1, 2):
        threads(n_threads)
        for rows in (1, 5, 17):
            x = torch.randn(rows, 256)
            y = native.linear(m, x, bias)
            alone = [native.linear(native.matrix(p), x, b) for p, b in zip(parts, bias.split([r for _, r in shapes]))]
            assert torch.equal(y, torch.cat(alone, dim=1))
            assert torch.equal(native.linear(m, x), torch.cat([native.linear(native.matrix(p), x) for p in parts], 1))
            want = reference.linear(ref_w, x, bias)
            assert (y - want).abs().max() < 0.02 * want.abs().max()


def test_a_stack_of_parts_with_different_columns_is_an_error():
    a = kernels.cpu.QMatrix(np.zeros(16 * 32 * 4, np.uint8), 0, 16, 32)
    b = kernels.cpu.QMatrix(np.zeros(16 * 64 * 4, np.uint8), 0, 16, 64)
    with pytest.raises(ValueError, match="part 1 has 64 columns, part 0 32"):
        kernels.cpu.QMatrixStack([a, b])
    with pytest.raises(ValueError, match="at least one part"):
        kernels.cpu.QMatrixStack([])


def test_native_gpt_oss_mxfp4_experts_run_as_q8_0(tmp_path):
    """gpt-oss's MXFP4 experts (its release's format) repacked losslessly to Q8_0 blocks at load (every scale of these
    fits an fp16): the native matrices are Q8_0 and hold the MXFP4 values exactly; the logits near the reference path
    (which dequantizes the MXFP4) as other quantized experts are, and bitwise batch-invariant."""
    from gguf import GGMLQuantizationType

    hf = make_hf_model("gpt_oss", tmp_path / "hf")
    path = write_gguf(hf, tmp_path / "m-MXFP4.gguf", "MXFP4")
    native, _, _ = load_model(path, kernels="native")
    reference, _, _ = load_model(path, kernels="reference")
    layer = native.layers[0]
    assert {m.qtype for m in layer.experts.gate_up + layer.experts.down} == {int(GGMLQuantizationType.Q8_0)}
    want = reference.layers[0].experts.down[3]  # float32, dequantized from the MXFP4 bytes
    got = torch.empty(want.shape)
    ids = torch.arange(want.shape[0])
    layer.experts.down[3].dequantize_rows(ids.data_ptr(), ids.shape[0], got.data_ptr())
    assert torch.equal(got, want)
    assert_native_close(path, MOE_QUANTIZED_TOLERANCE)
    model = native
    cache = PagedKVCache(model.config, num_blocks=64, block_size=4)
    seq = PROMPT + [31, 41]
    alone = run(model, [[SequenceChunk(seq, 0, list(range(8)), all_logits=True)]], cache)[0]
    steps = [[SequenceChunk([7] * 11, 0, list(range(8, 16))), SequenceChunk(seq, 0, list(range(8)), all_logits=True)]]
    assert torch.equal(run(model, steps, cache)[0][1:], alone)


def assert_native_close(path, tolerance: float) -> None:
    """The prompt's logits at every position and three decode steps: native within tolerance x the largest
    reference logit."""
    native, _, _ = load_model(path, kernels="native")
    reference, _, _ = load_model(path, kernels="reference")
    assert native.backend.name == "native" and reference.backend.name == "reference"
    tokens = torch.tensor(PROMPT)

    def native_cache():  # float32, as the reference's, whatever the native default
        return SequenceKVCache(native.config, 64, dtype=torch.float32)

    want = reference(tokens, 0, SequenceKVCache.for_model(reference, 64), all_logits=True)
    got = native(tokens, 0, native_cache(), all_logits=True)
    scale = want.abs().max()
    assert (got - want).abs().max() <= tolerance * scale
    # decode steps through the cache agree too
    cache_n, cache_r = native_cache(), SequenceKVCache.for_model(reference, 64)
    native(tokens, 0, cache_n)
    reference(tokens, 0, cache_r)
    for step, token in enumerate([9, 99, 199]):
        t = torch.tensor([token])
        assert (native(t, len(PROMPT) + step, cache_n) - reference(t, len(PROMPT) + step, cache_r)).abs().max() <= tolerance * scale


def run(model, chunks_per_step, cache):
    """Run a list of steps (each a list of SequenceChunk); logits rows of every step, concatenated."""
    return [model.forward_batch(ForwardBatch.build(chunks, cache.block_size), cache) for chunks in chunks_per_step]


@pytest.mark.parametrize("qtype", ["Q4_0", "F16"])
def test_a_tokens_logits_do_not_depend_on_the_batch_or_the_chunking(hf_dir, qtype, tmp_path):
    model, _, _ = load_model(model_path(hf_dir, qtype, tmp_path), kernels="native")
    cache = PagedKVCache(model.config, num_blocks=64, block_size=4)
    seq = PROMPT + [31, 41]
    table_a = list(range(0, 8))
    # alone, whole prompt in one step, every position's logits
    alone = run(model, [[SequenceChunk(seq, 0, table_a, all_logits=True)]], cache)[0]
    # in chunks of 5, 7, 8 tokens, each step beside two other sequences of other lengths
    others = [[3, 4, 5] * 5, [7] * 11]
    table_b, table_c = list(range(8, 16)), list(range(16, 24))
    steps, start = [], 0
    for size in (5, 7, 8):
        steps.append([
            SequenceChunk(others[0][: min(15, start + size)], min(start, 14), table_b),
            SequenceChunk(seq[: start + size], start, table_a, all_logits=True),
            SequenceChunk(others[1][: min(11, start + size)], min(start, 10), table_c),
        ])
        start += size
    rows = []
    for out, chunks in zip(run(model, steps, cache), steps):
        # logits rows come in flat order: other seq's last token, then this seq's tokens, then the other's last
        rows.append(out[1 : 1 + len(chunks[1].token_ids) - chunks[1].start])
    assert torch.equal(torch.cat(rows), alone)


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "phi3"])
def test_windowed_layers_far_past_their_window(arch, tmp_path):
    """A 200-token prompt, windows of 8: the kernel skips the 64-position partitions behind a window and masks
    inside the one it starts in. Close to the reference path, and each token's logits bitwise the same when the
    prompt runs whole or in chunks beside another sequence."""
    hf = make_hf_model(arch, tmp_path / arch)
    native, _, _ = load_model(hf, kernels="native")
    reference, _, _ = load_model(hf, kernels="reference")
    seq = (PROMPT * 12)[:200]
    assert len(seq) > 64 * 2 + SLIDING_WINDOW
    want = reference(torch.tensor(seq), 0, SequenceKVCache.for_model(reference, 256), all_logits=True)
    cache = PagedKVCache(native.config, num_blocks=128, block_size=16, dtype=torch.float32)
    table = list(range(0, 13))
    alone = run(native, [[SequenceChunk(seq, 0, table, all_logits=True)]], cache)[0]
    assert (alone - want).abs().max() <= 1e-4 * want.abs().max()
    other, other_table = [7, 8, 9] * 30, list(range(13, 19))
    steps, start = [], 0
    for size in (70, 1, 64, 65):
        steps.append([SequenceChunk(seq[: start + size], start, table, all_logits=True),
                      SequenceChunk(other[: min(90, start + size)], min(start, 89), other_table)])
        start += size
    rows = [out[: len(chunks[0].token_ids) - chunks[0].start] for out, chunks in zip(run(native, steps, cache), steps)]
    assert torch.equal(torch.cat(rows), alone)


def test_results_do_not_depend_on_the_thread_count(hf_dir, tmp_path):
    """Logits bitwise the one-thread run's with 2 and 3 threads, in runs where the pool's own counters show
    its workers computed part of the items. A run repeats until they did: a worker that gets its CPU late
    finds the caller has done everything (the pool lets the caller take any share nobody started), and on a
    busy host the pool may judge its workers starved and run jobs on the caller alone for a while (solo mode,
    which set_num_threads ends: a try that ran solo starts the pool afresh for the next)."""
    model, _, _ = load_model(model_path(hf_dir, "Q4_0", tmp_path), kernels="native")
    tokens = torch.tensor((PROMPT * 12)[:200])  # matmuls long enough for a woken worker to join in

    def run():
        return model(tokens, 0, SequenceKVCache.for_model(model, 256), all_logits=True)

    threads = kernels.cpu.get_num_threads()
    try:
        kernels.cpu.set_num_threads(1)
        alone = run()
        for n in (2, 3):
            kernels.cpu.set_num_threads(n)
            for _ in range(50):
                kernels.cpu.pool_stats(True)
                assert torch.equal(run(), alone)
                _, items, caller_items, _, _, solo_jobs = kernels.cpu.pool_stats()
                if caller_items < items:
                    break
                if solo_jobs:
                    kernels.cpu.set_num_threads(1)
                    kernels.cpu.set_num_threads(n)
            else:
                pytest.fail(f"with {n} threads the pool's workers computed none of the {items} items in 50 runs")
    finally:
        kernels.cpu.set_num_threads(threads)


def test_without_the_extension_auto_runs_the_reference_path_and_says_so(monkeypatch, caplog):
    from churon.loader import make_backend

    monkeypatch.setattr(kernels, "cpu", None)
    monkeypatch.setattr(kernels, "reason", "churon._cpu is not available (test)")
    with caplog.at_level("WARNING", logger="churon"):
        backend = make_backend("auto", torch.float32)
    assert backend.name == "reference"
    assert "reference path" in caplog.text and "not available (test)" in caplog.text
    with pytest.raises(RuntimeError, match="not available"):
        make_backend("native", torch.float32)
