"""Native CPU kernels (churon._cpu) against their references in churon.kernels.ground_truth.

Every test runs once per ISA the machine supports (forced with set_isa, restored after).

Tolerances, and why:
  * dequantize, dequantize_rows, rope: none. Same float32 operations in the same order as the
    ground truth (ggml's dequantization order; x*cos - x2*sin), so the results are bitwise equal.
  * quantized matmul, tight check: the kernels quantize activations to 8 bits per 32 values
    exactly as ground_truth.quantize_activations does (bitwise), then take integer dot products;
    the only differences from ground_truth.qmatmul_q8 (float64) are float32 roundings of the
    per-block scale products and of the accumulation over cols / 32 blocks. Bound:
    TIGHT_RTOL * max_i |W[r, i]| * sum_i |xq_i| per output (the scale/min terms of a block are
    at most ~3 max|W| in size, each rounding is 2^-24 relative, a few hundred blocks at most).
  * quantized matmul, against the float reference x @ W.T: the 8-bit rounding of x moves each
    output by at most sum_i |W[r, i]| * |x_i - xq_i| (a rigorous bound, computed from the data),
    plus the tight bound.
  * float weights (F32/F16/BF16) and rms_norm/add_rms_norm: float32 sums in a different order
    than torch: 1e-5 relative to the sum of absolute terms.
  * swiglu, softmax, attention: the kernels use their own vectorized exp (~2 ulp) and, for attention's
    soft-capping, tanh (~2 ulp): 1e-5.
Determinism: threads 1 and 2 give bitwise-equal results; a row computed alone (M = 1) equals
bitwise the same row computed inside a batch (M = 5, 17), for every kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from churon import kernels
from churon.formats.quants import dequantize, quantize
from churon.kernels import ground_truth as truth
from churon.engine.kv_cache import quantize_int8

pytestmark = pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason or "no native kernels")

cpu = kernels.cpu
ISAS = cpu.available_isas() if cpu is not None else []

QUANT_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
K_QUANTS = {T.Q4_K, T.Q5_K, T.Q6_K}
TIGHT_RTOL = 2e-6


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def weight_bytes(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return truth.random_weight_bytes(qtype, rows, cols, rng_for("weight", qtype.name, rows, cols, seed))


def cols_for(qtype: T, k: int = 2) -> int:
    return 256 * k if qtype in K_QUANTS else 96 * k  # multiples of the block size only


def activations(m: int, cols: int, seed: int = 0) -> torch.Tensor:
    rng = rng_for("x", m, cols, seed)
    x = rng.standard_normal((m, cols)).astype(np.float32) * rng.uniform(0.1, 4.0, size=(m, 1)).astype(np.float32)
    if m > 2:
        x[2, :64] = 0.0  # all-zero blocks: d = 0
    return torch.from_numpy(x)


def matmul(q, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.full((x.shape[0], q.rows), float("nan"))
    q.matmul(x.data_ptr(), y.data_ptr(), x.shape[0], bias.data_ptr() if bias is not None else 0)
    return y



# ---------------------------------------------------------------------------
# ISA selection and the module


def test_isa_api():
    assert "scalar" in ISAS
    assert cpu.isa() in ISAS
    with pytest.raises(ValueError, match="unknown ISA"):
        cpu.set_isa("sse9")
    before = cpu.isa()
    for name in ISAS:
        cpu.set_isa(name)
        assert cpu.isa() == name
    cpu.set_isa(before)


def test_weights_are_prefetched_ahead_on_intel_cpus_only():
    # the vendor as Linux reports it: Intel's L3 serves the weights faster with the prefetch, AMD's slower
    vendors = {line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")}
    assert cpu.prefetch_weights_ahead() == (vendors == {"GenuineIntel"})


def test_isa_env_var():
    code = "from churon import kernels; print(kernels.cpu.isa())"
    env = dict(os.environ, CHURON_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "scalar"
    env["CHURON_ISA"] = "bogus"
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ISAS[0] and "CHURON_ISA=bogus" in out.stderr


def test_threads_setting(threads):
    threads(1)
    assert cpu.get_num_threads() == 1
    threads(3)
    assert cpu.get_num_threads() == 3


def test_qmatrix_errors():
    with pytest.raises(ValueError, match="needs 720 bytes"):
        cpu.QMatrix(np.zeros(700, np.uint8), int(T.Q4_1), 2, 576)
    with pytest.raises(ValueError, match="multiple of 256"):
        cpu.QMatrix(np.zeros(144, np.uint8), int(T.Q4_K), 2, 128)
    with pytest.raises(ValueError, match="not supported"):
        cpu.QMatrix(np.zeros(64, np.uint8), int(T.Q2_K), 1, 256)
    q = cpu.QMatrix(weight_bytes(T.Q4_1, 16, 64), int(T.Q4_1), 16, 64)
    with pytest.raises(ValueError, match="null pointer"):
        q.matmul(0, 0, 1)
    assert q.rows == 16 and q.cols == 64 and q.qtype == int(T.Q4_1) and "x16" in q.layout


# ---------------------------------------------------------------------------
# dequantization


@pytest.mark.parametrize("qtype", QUANT_TYPES + FLOAT_TYPES, ids=lambda t: t.name)
def test_dequantize_bitwise(isa, qtype):
    for rows, k in [(1, 1), (17, 2), (40, 3)]:
        cols = cols_for(qtype, k)
        raw = weight_bytes(qtype, rows, cols)
        q = cpu.QMatrix(raw, int(qtype), rows, cols)
        want = dequantize(raw, qtype, (rows, cols))
        got = torch.empty(rows, cols)
        q.dequantize(got.data_ptr())
        assert torch.equal(got, want)
        bf = torch.empty(rows, cols, dtype=torch.bfloat16)
        q.dequantize_bf16(bf.data_ptr())
        assert torch.equal(bf, want.to(torch.bfloat16))
        ids = torch.tensor([rows - 1, 0, rows // 2, rows - 1], dtype=torch.int64)
        got_rows = torch.empty(4, cols)
        q.dequantize_rows(ids.data_ptr(), 4, got_rows.data_ptr())
        assert torch.equal(got_rows, want[ids])


def test_dequantize_rows_checks_ids():
    q = cpu.QMatrix(weight_bytes(T.Q8_0, 4, 32), int(T.Q8_0), 4, 32)
    ids = torch.tensor([4], dtype=torch.int64)
    out = torch.empty(1, 32)
    with pytest.raises(IndexError, match="outside"):
        q.dequantize_rows(ids.data_ptr(), 1, out.data_ptr())


def test_real_gguf_quantized_data(isa):
    # data quantized by the gguf package (not random codes): dequantize must still match
    import gguf.quants as gq

    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0):
        data = rng_for("real", qtype.name).standard_normal((19, 160)).astype(np.float32)
        raw = np.ascontiguousarray(gq.quantize(data, qtype)).reshape(-1).view(np.uint8)
        q = cpu.QMatrix(raw, int(qtype), 19, 160)
        got = torch.empty(19, 160)
        q.dequantize(got.data_ptr())
        assert torch.equal(got, dequantize(raw, qtype, (19, 160)))


# ---------------------------------------------------------------------------
# activation quantization reference: the properties the tight bound relies on


def test_quantize_activations_reference():
    x = activations(5, 96)
    q, d = truth.quantize_activations(x)
    assert q.dtype == torch.int8 and d.shape == (5, 3)
    assert int(q.abs().max()) <= 127
    err = (x.double() - truth.dequantize_activations(q, d)).abs().reshape(5, 3, 32)
    assert bool((err <= d.double().unsqueeze(-1) * 0.5 * (1 + 1e-6)).all())
    assert bool((q[2, :64] == 0).all()) and bool((d[2, :2] == 0).all())


# ---------------------------------------------------------------------------
# quantized matmul


def check_quant_matmul(qtype: T, raw: np.ndarray, rows: int, cols: int, x: torch.Tensor, y: torch.Tensor) -> None:
    w = dequantize(raw, qtype, (rows, cols)).double()
    xq, d = truth.quantize_activations(x)
    xhat = truth.dequantize_activations(xq, d)
    want_q8 = xhat @ w.T
    tight = TIGHT_RTOL * w.abs().amax(1).unsqueeze(0) * xhat.abs().sum(1, keepdim=True) + 1e-30
    err = (y.double() - want_q8).abs()
    assert bool((err <= tight).all()), f"tight: worst err/bound {float((err / tight).max()):.3g}"
    want = x.double() @ w.T
    loose = (x.double() - xhat).abs() @ w.abs().T + tight
    err = (y.double() - want).abs()
    assert bool((err <= loose).all()), f"loose: worst err/bound {float((err / loose).max()):.3g}"


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_quant_matmul(isa, qtype, m):
    rows = 37  # not a multiple of the 16-row interleave
    cols = cols_for(qtype)
    raw = weight_bytes(qtype, rows, cols)
    q = cpu.QMatrix(raw, int(qtype), rows, cols)
    x = activations(m, cols)
    check_quant_matmul(qtype, raw, rows, cols, x, matmul(q, x))


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_quant_matmul_wide_rows(isa, qtype):
    # rows of 16 activation blocks or more: AVX-512 quantizes 16 blocks at a time, then the rest one by one
    rows, cols = 37, 768 if qtype in K_QUANTS else 32 * 19
    raw = weight_bytes(qtype, rows, cols)
    q = cpu.QMatrix(raw, int(qtype), rows, cols)
    for m in (1, 17):
        x = activations(m, cols)
        x[0, 32 * 3 + 5], x[0, 32 * 17 + 5] = 40.0, -40.0  # a block far larger than the others, in each part
        check_quant_matmul(qtype, raw, rows, cols, x, matmul(q, x))


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 5, 17])
def test_float_matmul(isa, qtype, m):
    for rows, cols in [(37, 100), (5, 7), (33, 64)]:  # float weights take any column count
        raw = weight_bytes(qtype, rows, cols)
        q = cpu.QMatrix(raw, int(qtype), rows, cols)
        x = activations(m, cols)
        y = matmul(q, x)
        w = dequantize(raw, qtype, (rows, cols)).double()
        want = x.double() @ w.T
        tol = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-30
        assert bool(((y.double() - want).abs() <= tol).all())


@pytest.mark.parametrize("narrow, qtype", [(torch.bfloat16, T.BF16), (torch.float16, T.F16)], ids=["bf16", "f16"])
def test_float32_weights_holding_bf16_or_fp16_values_are_stored_narrow_with_the_same_results(isa, narrow, qtype):
    from churon.model.native_backend import NativeBackend

    rows, cols = 37, 100
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))
    # zeros of both signs, a subnormal of the narrow type, a power of two: all exact in it
    w[0, :4] = torch.tensor([0.0, -0.0, 1e-40 if narrow is torch.bfloat16 else 2.0**-20, -3.5])
    w = w.to(narrow).float()  # a bf16 / fp16 checkpoint as the Hugging Face reader hands it over
    wide = cpu.QMatrix(w.view(torch.uint8).numpy().reshape(-1), int(T.F32), rows, cols)
    q = NativeBackend().matrix(w)
    assert q.qtype == int(qtype) and q.nbytes == wide.nbytes // 2
    for m in (1, 5, 17):
        x = activations(m, cols)
        assert torch.equal(matmul(q, x), matmul(wide, x))
        assert torch.equal(NativeBackend().linear_precise(q, x), NativeBackend().linear_precise(wide, x))
    assert NativeBackend().matrix(w * (1 + 2.0**-20)).qtype == int(T.F32)  # not every value narrow: float32 kept


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_matmul_precise(isa, qtype, threads):
    # precise: x = hi + lo, both 8-bit quantized; the error left is that of quantizing lo
    rows, cols, m = 37, cols_for(qtype), 3
    raw = weight_bytes(qtype, rows, cols)
    q = cpu.QMatrix(raw, int(qtype), rows, cols)
    x = activations(m, cols)
    bias = torch.randn(rows)
    y = torch.empty(m, rows)
    q.matmul(x.data_ptr(), y.data_ptr(), m, bias.data_ptr(), True)
    w = dequantize(raw, qtype, (rows, cols)).double()
    hi, lo = truth.split_activations(x)
    lo_hat = truth.dequantize_activations(*truth.quantize_activations(lo))
    xhat = hi.double() + lo_hat
    tight = TIGHT_RTOL * w.abs().amax(1).unsqueeze(0) * xhat.abs().sum(1, keepdim=True)
    want = x.double() @ w.T + bias.double()
    bound = (x.double() - xhat).abs() @ w.abs().T + tight + 1e-6 * bias.double().abs()
    err = (y.double() - want).abs()
    assert bool((err <= bound).all()), f"worst err/bound {float((err / bound).max()):.3g}"
    plain_err = (matmul(q, x).double() + bias.double() - want).abs()
    assert float(err.max()) < float(plain_err.max()) / 20  # about 127x finer activations
    # batch invariance and thread invariance hold as for the plain matmul
    one = torch.empty(1, rows)
    q.matmul(x[1:2].contiguous().data_ptr(), one.data_ptr(), 1, bias.data_ptr(), True)
    assert torch.equal(one, y[1:2])
    threads(1)
    y1 = torch.empty(m, rows)
    q.matmul(x.data_ptr(), y1.data_ptr(), m, bias.data_ptr(), True)
    assert torch.equal(y1, y)


def _precise(q, x: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], q.rows)
    q.matmul(x.data_ptr(), y.data_ptr(), x.shape[0], 0, True)
    return y


def _argmax_logits(q, x: torch.Tensor) -> torch.Tensor:
    y = torch.full((x.shape[0], q.rows), float("nan"))
    q.matmul_argmax(x.data_ptr(), y.data_ptr(), x.shape[0])
    return y


def _check_argmax(got: torch.Tensor, want: torch.Tensor, plain: torch.Tensor, where: str) -> torch.Tensor:
    """got (matmul_argmax) against want (the precise product) and plain (8-bit activations): each value is want's or
    plain's bit for bit, plain's only strictly below the row's maximum, NaN where want has NaN; each row's first
    maximum the same as numpy (the sampler) finds it, NaN first. The mask of want's values."""
    precise = (got == want) | (got.isnan() & want.isnan())
    assert torch.equal(got.isnan(), want.isnan()), f"{where}: a NaN dropped or made"
    assert torch.equal(got[~precise], plain[~precise]), f"{where}: a value neither the precise nor the 8-bit product"
    rows = ~want.isnan().any(1)
    top = want[rows].amax(1, keepdim=True).expand(-1, want.shape[1])
    assert bool((got[rows][~precise[rows]] < top[~precise[rows]]).all()), f"{where}: an 8-bit value reaches the maximum"
    assert np.array_equal(got.numpy().argmax(1), want.numpy().argmax(1)), where
    return precise


def _logit_weights(qtype: T, rows: int, cols: int) -> tuple[torch.Tensor, np.ndarray]:
    """An output matrix whose rows 3, 7 (a copy of 3: an exact tie) and 11 (3 nudged: ties within the lo part)
    lead for activations along row 3."""
    rng = rng_for("logit weights", qtype.name, rows, cols)
    w = torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32)) * 0.05
    w[7] = w[3]
    w[11] = w[3]
    w[11, 5] += 1e-4
    raw = quantize(w, qtype.name)
    return dequantize(raw, qtype, (rows, cols)), raw


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1], ids=lambda t: t.name)
def test_matmul_argmax(isa, qtype, threads):
    # greedy decoding's logits: each row's first maximum is the precise product's; every value is the precise
    # product's or, strictly below the row's maximum, the 8-bit one's; a Q8_0 matrix from 2 rows skips the lo product
    # for most weight rows (one row, other types: the precise product itself)
    rows, cols = 16 * 70 + 5, 192  # a partial last group
    w, raw = _logit_weights(qtype, rows, cols)
    q = cpu.QMatrix(raw, int(qtype), rows, cols)
    for m in (1, 2, 5, 9, 16, 20, 40):
        rng = rng_for("logit x", m)
        x = torch.from_numpy(rng.standard_normal((m, cols)).astype(np.float32))
        x[:, 40] *= 30  # an outlier channel, as real hidden states have
        x[::2] += 4 * w[3] / w[3].norm() * float(cols) ** 0.5  # even rows: rows 3, 7 and 11 lead
        if m > 4:
            x[4] = 0  # an all-zero row: every value 0, the first one the maximum
        want, got = _precise(q, x), _argmax_logits(q, x)
        kept = _check_argmax(got, want, matmul(q, x), f"m={m}")
        assert bool((want[::2, 3] == want[::2, 7]).all()) and int(want[0].argmax()) in (3, 11)
        assert 7 not in got[::2].argmax(1).tolist()  # the exact tie of rows 3 and 7 goes to the first
        skipping = qtype == T.Q8_0 and m >= 2
        assert bool(kept.all()) != skipping, f"m={m}: {int((~kept).sum())} values without their lo product"
        if skipping:
            assert float(kept.float().mean()) < 0.5  # most of the lo product skipped
    # rows alone equal rows in a batch, on one thread as on two
    x = torch.from_numpy(rng_for("logit x", 9).standard_normal((9, cols)).astype(np.float32))
    batch = _argmax_logits(q, x)
    threads(1)
    assert torch.equal(_argmax_logits(q, x), batch)
    assert torch.equal(_argmax_logits(q, x[:3].contiguous()).argmax(1), batch[:3].argmax(1))


def _q8_0_codes(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF Q8_0 matrix's codes [rows, cols] (int) and block scales [rows, cols / 32] (float64)."""
    blocks = raw.reshape(rows, cols // 32, 34)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float64)
    return blocks[:, :, 2:].copy().view(np.int8).astype(np.int64).reshape(rows, cols), d


def test_matmul_argmax_one_row(isa, threads):
    # One row (greedy decoding's step) reads the coarse copy prepare_argmax builds (each code's top 6 bits), then the
    # precise product of the groups that may hold the maximum: each value is the precise product's or, strictly below
    # the row's maximum, about |x| |w_r - coarse w_r| from it at most. Where the ISA has no coarse kernel, or before
    # prepare_argmax, the precise product itself.
    rows, cols = 16 * 70 + 5, 192
    w, raw = _logit_weights(T.Q8_0, rows, cols)
    q = cpu.QMatrix(raw, int(T.Q8_0), rows, cols)
    codes, d = _q8_0_codes(raw, rows, cols)
    coarse = np.minimum((codes + 2) >> 2, 31) * 4
    residual = np.sqrt(((codes - coarse) ** 2 * np.repeat(d, 32, axis=1) ** 2).sum(1))
    whole = np.sqrt((codes**2 * np.repeat(d, 32, axis=1) ** 2).sum(1))
    xs = torch.from_numpy(rng_for("one-row x").standard_normal((6, cols)).astype(np.float32))
    xs[:, 40] *= 30
    xs[::2] += 4 * w[3] / w[3].norm() * float(cols) ** 0.5  # rows 3, 7 (a tie) and 11 lead
    x1 = lambda i: xs[i : i + 1].contiguous()
    unprepared = [_argmax_logits(q, x1(i)) for i in range(len(xs))]
    assert all(torch.equal(u, _precise(q, x1(i))) for i, u in enumerate(unprepared))
    before = q.nbytes
    built = q.prepare_argmax()
    assert built == (isa in ("avx512", "amx")), isa
    assert q.nbytes - before == (416 * 71 * 6 if built else 0)
    assert q.prepare_argmax() == built and q.nbytes - before == (416 * 71 * 6 if built else 0)  # built once
    for i in range(len(xs)):
        want, got = _precise(q, x1(i)), _argmax_logits(q, x1(i))
        assert np.array_equal(got.numpy().argmax(1), want.numpy().argmax(1)), i
        kept = got == want
        assert bool((got[~kept] < want.max()).all()), f"row {i}: a coarse value reaches the maximum"
        err = (got - want).abs().double()[0]
        # hi's coarse product: hi . res_r + lo . w_r from the precise one, lo below 1/40 of x (8-bit blocks)
        near = float(xs[i].norm()) * torch.from_numpy(1.01 * residual + whole / 40)
        assert bool((err <= near + 1e-6).all()), i
        if built:
            assert float(kept.float().mean()) < 0.5, f"row {i}: {int(kept.sum())} of {rows} values precise"
            if i % 2 == 0:  # the leaders' values are the precise ones
                assert bool(kept[0, [3, 7, 11]].all())
        else:
            assert bool(kept.all())
        if i % 2 == 0:
            assert int(got.argmax()) == 3  # the exact tie of rows 3 and 7 goes to the first
    threads(1)
    one_thread = [_argmax_logits(q, x1(i)) for i in range(len(xs))]
    threads(2)
    assert all(torch.equal(o, _argmax_logits(q, x1(i))) for i, o in enumerate(one_thread))
    # NaN, inf and huge values in x: NaN where the precise product has it (inf: some), the same first maximum
    for bad in (float("nan"), float("inf"), 1e38):
        x = x1(0).clone()
        x[0, 9] = bad
        want, got = _precise(q, x), _argmax_logits(q, x)
        assert torch.equal(got.isnan(), want.isnan()) and (bad != float("inf") or bool(want.isnan().any()))
        assert np.array_equal(got.numpy().argmax(1), want.numpy().argmax(1)), bad
        kept = got == want
        assert bool((got[~kept & ~got.isnan()] < want.max()).all())
    # other types have no coarse copy
    q4 = cpu.QMatrix(quantize(w, "Q4_1"), int(T.Q4_1), rows, cols)
    assert not q4.prepare_argmax()


def test_matmul_argmax_one_row_coarse_order_differs(isa):
    # Weight row 5 leads the precise product (codes 81: coarse 80, +1 each), row 489 (another group) the coarse one
    # (half its codes 82: coarse 84, -2; half 79: coarse 80, -1): the bound must send row 5's group to its precise
    # product too, or row 489 would win
    rows, cols = 16 * 40, 64
    rng = rng_for("coarse order")
    codes = rng.integers(-40, 41, size=(rows, cols))
    codes[5] = 81
    codes[489] = np.tile(np.repeat([82, 79], 16), cols // 32)
    blocks = np.zeros((rows, cols // 32, 34), dtype=np.uint8)
    blocks[:, :, :2] = np.full((rows, cols // 32, 1), 0.01, dtype=np.float16).view(np.uint8)
    blocks[:, :, 2:] = codes.reshape(rows, cols // 32, 32).astype(np.int8).view(np.uint8)
    q = cpu.QMatrix(blocks.reshape(-1), int(T.Q8_0), rows, cols)
    x = torch.ones(1, cols)
    want = _precise(q, x)
    assert int(want.argmax()) == 5 and float(want[0, 5]) > float(want[0, 489])
    if q.prepare_argmax():
        got = _argmax_logits(q, x)
        assert float(got[0, 489]) == float(want[0, 489])  # the coarse leader's group went precise
        assert int(got.argmax()) == 5 and float(got[0, 5]) == float(want[0, 5])


def test_matmul_argmax_non_finite_rows():
    # rows with NaN, inf or huge values in x: the bound holds on the codes the kernel multiplies, and a row with a
    # non-finite value gets the whole precise product, NaN included (the sampler's check sees it)
    rows, cols = 16 * 8, 64
    w, raw = _logit_weights(T.Q8_0, rows, cols)
    q = cpu.QMatrix(raw, int(T.Q8_0), rows, cols)
    x = torch.randn(4, cols)
    x[1, 9] = float("nan")
    x[2, 9] = 1e38
    x[3, 9] = float("inf")
    want, got = _precise(q, x), _argmax_logits(q, x)
    assert bool(want[3].isnan().all()) and not bool(want[:3].isnan().any())
    kept = _check_argmax(got, want, matmul(q, x), "non-finite x")
    assert not bool(kept[0].all())  # the ordinary row still skips


def test_matmul_argmax_refuses_bad_arguments():
    rows, cols = 32, 64
    _, raw = _logit_weights(T.Q8_0, rows, cols)
    q = cpu.QMatrix(raw, int(T.Q8_0), rows, cols)
    y = torch.empty(3, rows)
    with pytest.raises(ValueError, match="m must be >= 0"):
        q.matmul_argmax(0, y.data_ptr(), -1)
    with pytest.raises(ValueError, match="x is a null pointer"):
        q.matmul_argmax(0, y.data_ptr(), 3)
    q.matmul_argmax(0, 0, 0)  # no rows: nothing read or written


def _anon_huge_kb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no AnonHugePages line in /proc/self/smaps_rollup")


def test_small_matrices_share_huge_pages():
    # a decode step streams every matrix from DRAM: hundreds of small ones (an expert's 576 KB), each on 4 KiB pages
    # of its own allocation, would take a TLB miss every 4 KiB; they are packed into slabs backed by huge pages
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(thp) or "[never]" in open(thp).read() or not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("no transparent huge pages here (Linux THP off or absent)")
    raw = np.zeros(1024 * 4 * 144, np.uint8)  # a 1024 x 1024 Q4_K matrix: 576 KB
    before = _anon_huge_kb()
    mats = [cpu.QMatrix(raw, int(T.Q4_K), 1024, 1024) for _ in range(96)]  # 54 MB: at least one slab of their own
    held = _anon_huge_kb() - before
    assert held >= 32 * 1024, f"{held} KB of huge pages for 54 MB of matrices"
    del mats  # a slab goes with its last matrix (the one they began may hold earlier tests' matrices too)
    assert _anon_huge_kb() - before <= held - 16 * 1024


def test_q5_0_matmul_equals_its_q8_0_blocks(isa):
    # Q5_0 (Gemma 3 270M's q, k, gate and up projections) has its own 5.5-bit layout; x = d * (L - 16) is also
    # the Q8_0 code L - 16 with the same scale, and both kernels take the offset out in the integer sum, so the
    # matmul is bitwise that of those Q8_0 blocks (what a Q5_0 part fused with Q8_0 ones runs as), within the
    # Q8_0 path's bounds of the F32 path on the dequantized matrix, and the dequantized rows are exact
    from churon.formats.gguf import GGUFTensor
    from churon.kernels import ops
    from churon.model.native_backend import NativeBackend

    rows, cols = 37, 192
    w = torch.from_numpy(rng_for("q5_0").standard_normal((rows, cols)).astype(np.float32))
    raw = quantize(w, T.Q5_0).reshape(-1)
    q = NativeBackend().matrix(GGUFTensor("w", (rows, cols), T.Q5_0, raw))
    assert q.qtype == int(T.Q5_0) and q.nbytes == 3 * 6 * 352  # 3 row groups x 6 units of 32 columns
    dq = dequantize(raw, T.Q5_0, (rows, cols))
    blocks = raw.reshape(-1, 22)
    d = torch.from_numpy(blocks[:, :2].copy().view(np.float16).astype(np.float32))  # [n, 1]
    codes = torch.where(d != 0, dq.reshape(-1, 32) / d.where(d != 0, torch.ones_like(d)), torch.zeros_like(d))
    q8_raw = np.concatenate([blocks[:, :2], codes.to(torch.int8).numpy().view(np.uint8)], axis=1).reshape(-1)
    q8 = cpu.QMatrix(q8_raw, int(T.Q8_0), rows, cols)
    assert torch.equal(dequantize(q8_raw, T.Q8_0, (rows, cols)), dq)
    f32 = cpu.QMatrix(dq.numpy().view(np.uint8).reshape(-1), int(T.F32), rows, cols)
    for m in (1, 5, 17):
        x = activations(m, cols)
        y = matmul(q, x)
        assert torch.equal(y, matmul(q8, x))
        check_quant_matmul(T.Q5_0, raw, rows, cols, x, y)
        xhat = truth.dequantize_activations(*truth.quantize_activations(x))
        wa = dq.double().abs()
        bound = (x.double() - xhat).abs() @ wa.T + (TIGHT_RTOL * wa.amax(1) * xhat.abs().sum(1, keepdim=True)) \
            + 1e-5 * (x.double().abs() @ wa.T)  # 8-bit x, the tight bound, the F32 path's own rounding
        assert bool(((y.double() - matmul(f32, x).double()).abs() <= bound).all())
    ids = torch.tensor([36, 0, 17, 36])
    assert torch.equal(ops.QuantizedMatrix(raw, int(T.Q5_0), rows, cols).rows_of(ids), dq[ids])
    got = torch.empty(rows, cols)
    q.dequantize(got.data_ptr())
    assert torch.equal(got, dq)


def test_matmul_bias(isa):
    for qtype in (T.Q4_1, T.F32):
        rows, cols = 21, 64
        raw = weight_bytes(qtype, rows, cols)
        q = cpu.QMatrix(raw, int(qtype), rows, cols)
        x = activations(3, cols)
        bias = torch.randn(rows)
        assert torch.equal(matmul(q, x, bias), matmul(q, x) + bias)


@pytest.mark.parametrize("qtype", QUANT_TYPES + [T.F32, T.BF16], ids=lambda t: t.name)
def test_matmul_threads_and_batch_bitwise(isa, qtype, threads):
    rows = 16 * 13 + 5
    cols = cols_for(qtype)
    raw = weight_bytes(qtype, rows, cols)
    q = cpu.QMatrix(raw, int(qtype), rows, cols)
    x = activations(17, cols)
    threads(1)
    one = matmul(q, x)
    threads(2)
    two = matmul(q, x)
    assert torch.equal(one, two)
    # M = 1 rows equal the same rows of the M = 5 and M = 17 batches (full and remainder tiles)
    five = matmul(q, x[:5].contiguous())
    assert torch.equal(five, one[:5])
    for i in (0, 3, 4, 9, 16):
        assert torch.equal(matmul(q, x[i : i + 1].contiguous()), one[i : i + 1])


def test_matmul_large_m_parallel_quantization(isa, threads):
    # m * cols large enough that the activations are quantized in parallel
    qtype, rows, cols = T.Q8_0, 24, 2048
    raw = weight_bytes(qtype, rows, cols)
    q = cpu.QMatrix(raw, int(qtype), rows, cols)
    x = activations(40, cols)
    threads(2)
    y = matmul(q, x)
    check_quant_matmul(qtype, raw, rows, cols, x, y)
    threads(1)
    assert torch.equal(matmul(q, x), y)


# ---------------------------------------------------------------------------
# row ops


def test_rms_norm(isa, threads):
    for m, n in [(1, 576), (3, 100), (70, 576)]:  # the last is big enough to run in parallel
        x = activations(m, n) * 3
        w = torch.randn(n)
        out = torch.empty(m, n)
        cpu.rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, 1e-5)
        want = truth.rms_norm(x.double(), w.double(), 1e-5)
        tol = 1e-5 * (w.double().abs() * (x.double().abs() / x.double().pow(2).mean(-1, keepdim=True).sqrt()))
        assert bool(((out.double() - want).abs() <= tol + 1e-30).all())
        threads(1)
        one = torch.empty(m, n)
        cpu.rms_norm(x.data_ptr(), w.data_ptr(), one.data_ptr(), m, n, 1e-5)
        threads(2)
        assert torch.equal(one, out)
        row = torch.empty(1, n)
        cpu.rms_norm(x[m - 1 :].data_ptr(), w.data_ptr(), row.data_ptr(), 1, n, 1e-5)
        assert torch.equal(row, out[m - 1 :])


def test_add_rms_norm(isa):
    m, n = 5, 576
    residual = activations(m, n)
    x = activations(m, n, seed=1)
    w = torch.randn(n)
    want_res, want = truth.add_rms_norm(residual.clone(), x, w, 1e-6)
    res = residual.clone()
    out = torch.empty(m, n)
    cpu.add_rms_norm(res.data_ptr(), x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, 1e-6)
    assert torch.equal(res, want_res)  # one float32 add per element
    plain = torch.empty(m, n)
    cpu.rms_norm(want_res.data_ptr(), w.data_ptr(), plain.data_ptr(), m, n, 1e-6)
    assert torch.equal(out, plain)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_add_rms_norm_of_normed_x(isa, threads):
    # x_norm (Gemma's norms after attention and the MLP): residual += rms_norm(x, x_norm), then the norm of the
    # residual, in one call: bitwise the two kernels in turn, x left as it was; serial and parallel
    for m, nthreads in ((3, 1), (300, 2)):
        threads(nthreads)
        n = 640
        residual, x = activations(m, n), activations(m, n, seed=1) * 50
        w, x_norm = torch.randn(n), torch.rand(n) + 1
        normed = torch.empty(m, n)
        cpu.rms_norm(x.data_ptr(), x_norm.data_ptr(), normed.data_ptr(), m, n, 1e-6)
        torch.testing.assert_close(normed, truth.rms_norm(x, x_norm, 1e-6), rtol=1e-5, atol=1e-5)
        want_res, want_out = residual.clone(), torch.empty(m, n)
        cpu.add_rms_norm(want_res.data_ptr(), normed.data_ptr(), w.data_ptr(), want_out.data_ptr(), m, n, 1e-6)
        res, out, x0 = residual.clone(), torch.empty(m, n), x.clone()
        cpu.add_rms_norm(res.data_ptr(), x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, 1e-6, x_norm.data_ptr())
        assert torch.equal(res, want_res) and torch.equal(out, want_out) and torch.equal(x, x0)


def rope_tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def test_rope_bitwise(isa):
    cos, sin = rope_tables(300, 64)
    positions = torch.tensor([0, 7, 299, 5, 5, 123, 1], dtype=torch.int64)
    m = len(positions)
    # q and k in place inside a fused qkv row: 9 q heads, 3 k heads, 3 v heads (row stride 960)
    qkv = activations(m, 960)
    want_q = truth.rope(qkv[:, :576].reshape(m, 9, 64), positions, cos, sin)
    want_k = truth.rope(qkv[:, 576:768].reshape(m, 3, 64), positions, cos, sin)
    v = qkv[:, 768:].clone()
    got = qkv.clone()
    cpu.rope(got.data_ptr(), m, 9, 64, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), 960)
    cpu.rope(got.data_ptr() + 576 * 4, m, 3, 64, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), 960)
    assert torch.equal(got[:, :576].reshape(m, 9, 64), want_q)
    assert torch.equal(got[:, 576:768].reshape(m, 3, 64), want_k)
    assert torch.equal(got[:, 768:], v)
    # packed rows, an odd head_dim / 2, enough elements to run in parallel
    cos2, sin2 = rope_tables(64, 18)
    x = activations(60, 40 * 18).reshape(60, 40, 18)
    pos = torch.arange(60, dtype=torch.int64)
    want = truth.rope(x, pos, cos2, sin2)
    cpu.rope(x.data_ptr(), 60, 40, 18, pos.data_ptr(), cos2.data_ptr(), sin2.data_ptr())
    assert torch.equal(x, want)


def test_rope_and_cache_bitwise(isa, threads):
    cos, sin = rope_tables(100, 64)
    m, H, KV, hd = 5, 9, 3, 64
    qkv = activations(m, (H + 2 * KV) * hd)
    positions = torch.tensor([3, 4, 5, 99, 0], dtype=torch.int64)
    slots = torch.tensor([7, 8, -1, 30, 0], dtype=torch.int64)  # -1: a padding token, not written
    k_cache = torch.randn(4, 8, KV, hd)
    v_cache = torch.randn(4, 8, KV, hd)
    want_q, want_k, want_v = truth.rope_and_cache(qkv, H, KV, positions, cos, sin, k_cache, v_cache, slots)
    got = qkv.clone()
    cpu.rope_and_cache(got.data_ptr(), m, H, KV, hd, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                       k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr())
    assert torch.equal(got[:, : H * hd].reshape(m, H, hd), want_q)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # many tokens (parallel), rows strided inside a wider buffer
    m = 64
    wide = activations(m, 1000)
    qkv = wide[:, : (H + 2 * KV) * hd]
    positions = torch.arange(m, dtype=torch.int64)
    slots = torch.randperm(m, generator=torch.Generator().manual_seed(1)).to(torch.int64)
    k_cache, v_cache = torch.zeros(8, 8, KV, hd), torch.zeros(8, 8, KV, hd)
    want_q, want_k, want_v = truth.rope_and_cache(qkv, H, KV, positions, cos, sin, k_cache, v_cache, slots)
    threads(2)
    cpu.rope_and_cache(qkv.data_ptr(), m, H, KV, hd, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                       k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), 1000)
    assert torch.equal(qkv[:, : H * hd].reshape(m, H, hd), want_q)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_rope_and_cache_head_norms(isa, threads):
    # q_norm / k_norm (Qwen3, Gemma 3): each head of q and k RMS-normalized first, bitwise what the rms_norm
    # kernel gives on those heads, then RoPE and the cache as without; strided rows, serial and parallel
    cos, sin = rope_tables(64, 64)
    H, KV, hd, eps = 9, 3, 64, 1e-6
    q_norm, k_norm = torch.rand(hd) + 0.5, torch.rand(hd) * 2
    for m, nthreads in ((3, 1), (64, 2)):
        threads(nthreads)
        wide = activations(m, 1000) * 7
        qkv = wide[:, : (H + 2 * KV) * hd]
        positions = torch.arange(m, dtype=torch.int64)
        slots = torch.arange(m, dtype=torch.int64)
        normed = qkv.clone()
        for cols, heads, w in ((slice(0, H * hd), H, q_norm), (slice(H * hd, (H + KV) * hd), KV, k_norm)):
            part = normed[:, cols].contiguous()
            cpu.rms_norm(part.data_ptr(), w.data_ptr(), part.data_ptr(), m * heads, hd, eps)
            normed[:, cols] = part
            ref = truth.rms_norm(qkv[:, cols].reshape(m, heads, hd), w, eps).reshape(m, -1)
            assert torch.allclose(part, ref, rtol=1e-5, atol=1e-6)
        k_cache, v_cache = torch.zeros(8, 8, KV, hd), torch.zeros(8, 8, KV, hd)
        want_q, want_k, want_v = truth.rope_and_cache(normed, H, KV, positions, cos, sin, k_cache, v_cache, slots)
        cpu.rope_and_cache(qkv.data_ptr(), m, H, KV, hd, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                           k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), 1000, "float32", 0, 0,
                           q_norm.data_ptr(), k_norm.data_ptr(), eps)
        assert torch.equal(qkv[:, : H * hd].reshape(m, H, hd), want_q)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        cpu.rope_and_cache(qkv.data_ptr(), m, H, KV, hd, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                           k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), 1000, "float32", 0, 0,
                           q_norm.data_ptr(), 0, eps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rope_and_cache_low_precision(isa, dtype):
    # position 0 (cos 1, sin 0) passes k through unchanged: the cache must hold k.to(dtype) bitwise,
    # round to nearest even, including fp16 overflow, subnormals and ties
    H, KV, hd = 2, 1, 16
    special = torch.tensor([65504.0, 65519.0, 65520.0, 1e6, -2.0**-25, 2.0**-24 * 1.5, 2.0**-24 * 2.5, 6e-8,
                            1e-30, -0.0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 3.0e38, -7.5e-5, 0.1])
    qkv = torch.randn(3, (H + 2 * KV) * hd) * 100
    qkv[0, H * hd : (H + 1) * hd] = special
    qkv[1, (H + 1) * hd :] = special
    positions = torch.zeros(3, dtype=torch.int64)
    slots = torch.tensor([0, 1, 2], dtype=torch.int64)
    cos, sin = rope_tables(4, hd)
    k_cache = torch.zeros(1, 4, KV, hd, dtype=dtype)
    v_cache = torch.zeros(1, 4, KV, hd, dtype=dtype)
    _, want_k, want_v = truth.rope_and_cache(qkv, H, KV, positions, cos, sin, k_cache, v_cache, slots)
    cpu.rope_and_cache(qkv.data_ptr(), 3, H, KV, hd, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                       k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), 0, str(dtype).split(".")[1])
    assert torch.equal(k_cache.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), want_v.view(torch.int16))
    with pytest.raises(ValueError, match="kv_dtype"):
        cpu.rope_and_cache(qkv.data_ptr(), 3, H, KV, hd, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                           k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), 0, "int4")


def test_rope_and_cache_int8(isa, threads):
    # the kernel quantizes each (token, kv head) like churon.engine.kv_cache.quantize_int8, bitwise
    cos, sin = rope_tables(64, 64)
    m, H, KV, hd = 40, 9, 3, 64
    qkv = activations(m, (H + 2 * KV) * hd) * 3
    qkv[0, H * hd : (H + 1) * hd] = 0.0  # an all-zero head: scale 0, values 0
    positions = torch.arange(m, dtype=torch.int64)
    slots = torch.randperm(m, generator=torch.Generator().manual_seed(2)).to(torch.int64)
    slots[5] = -1
    want_q, k_f32, v_f32 = truth.rope_and_cache(qkv, H, KV, positions, cos, sin, torch.zeros(5, 8, KV, hd),
                                              torch.zeros(5, 8, KV, hd), slots)
    want_k, want_ks = quantize_int8(k_f32)
    want_v, want_vs = quantize_int8(v_f32)
    assert int(want_k.abs().max()) == 127 and float(want_ks.view(-1, KV)[slots[0]][0]) == 0.0
    k, v = torch.zeros(5, 8, KV, hd, dtype=torch.int8), torch.zeros(5, 8, KV, hd, dtype=torch.int8)
    ks, vs = torch.zeros(5, 8, KV), torch.zeros(5, 8, KV)
    threads(2)
    cpu.rope_and_cache(qkv.data_ptr(), m, H, KV, hd, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                       k.data_ptr(), v.data_ptr(), slots.data_ptr(), 0, "int8", ks.data_ptr(), vs.data_ptr())
    assert torch.equal(qkv[:, : H * hd].reshape(m, H, hd), want_q)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert torch.equal(ks, want_ks) and torch.equal(vs, want_vs)
    # the dequantized cache is within half a quantization step of the float values
    assert ((k.float() * ks.unsqueeze(-1) - k_f32).abs() <= ks.unsqueeze(-1) / 2 + 1e-7).all()


def gated_bound(name: str, gu: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """swiglu: 1e-5 relative (the kernels' exp); geglu: the gate's GELU is the gelu kernel's own, so
    test_encoder_kernels' gelu tolerance times |up|, plus the product's rounding."""
    if name == "swiglu":
        return 1e-5 * want.abs() + 1e-6
    gate, up = gu.double().chunk(2, dim=-1)
    return (5e-6 * truth.gelu(gate, "tanh").abs() + 5e-8) * up.abs() + 6e-8 * want.abs()


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_gated_activations(isa, threads, name):
    kernel, reference = getattr(cpu, name), getattr(truth, name)
    for m, n in [(1, 1536), (3, 37), (30, 1536)]:
        gu = activations(m, 2 * n) * 4
        gu[0, :4] = torch.tensor([-100.0, 100.0, -1e-8, 0.0])
        out = torch.empty(m, n)
        kernel(gu.data_ptr(), out.data_ptr(), m, n)
        want = reference(gu.double())
        assert bool(((out.double() - want).abs() <= gated_bound(name, gu, want)).all())
        threads(1)
        one = torch.empty(m, n)
        kernel(gu.data_ptr(), one.data_ptr(), m, n)
        threads(2)
        assert torch.equal(one, out)
        row = torch.empty(1, n)
        kernel(gu[m - 1 :].data_ptr(), row.data_ptr(), 1, n)
        assert torch.equal(row, out[m - 1 :])


def test_softmax(isa):
    for m, n in [(1, 1), (4, 33), (5, 49152)]:
        x = activations(m, n) * 10
        out = torch.empty(m, n)
        cpu.softmax(x.data_ptr(), out.data_ptr(), m, n)
        torch.testing.assert_close(out.double(), truth.softmax(x.double()), rtol=1e-5, atol=1e-7)
        cpu.softmax(x.data_ptr(), x.data_ptr(), m, n)  # in place
        assert torch.equal(x, out)


# ---------------------------------------------------------------------------
# attention


def paged_cache(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, seed: int = 0):
    """A cache with each sequence's blocks scattered in a shuffled order (and unused padding)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(1, max(blocks_per))
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)  # -1: padding, never read
    i = 0
    for s, nb in enumerate(blocks_per):
        table[s, :nb] = perm[i : i + nb].to(torch.int32)
        i += nb
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    return k, v, table, torch.tensor(seq_lens, dtype=torch.int32)


def run_attention(q, k, v, table, lens, scale, q_stride=0):
    num_seqs = lens.shape[0]
    num_heads, head_dim = q.shape[1], k.shape[3]
    out = torch.full((num_seqs, num_heads, head_dim), float("nan"))
    cpu.attention_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lens.data_ptr(), out.data_ptr(),
                         num_seqs, num_heads, k.shape[2], head_dim, k.shape[1], scale, table.shape[1], q_stride)
    return out


@pytest.mark.parametrize(
    "seq_lens,num_heads,num_kv_heads,head_dim,block_size",
    [
        ([1], 9, 3, 64, 16),
        ([5, 17, 300, 0, 1], 9, 3, 64, 16),  # 300 > one 256-token partition; 0: empty sequence
        ([33, 600], 4, 4, 48, 32),  # MHA, head_dim not a multiple of 16, 3 partitions
        ([70], 8, 1, 20, 7),  # MQA, odd block size
        ([130, 64], 4, 2, 128, 16),  # head_dim 128
        ([(i * 29) % 200 for i in range(37)], 9, 3, 64, 16),  # three blocks of query tasks, the last partial
    ],
)
def test_attention_decode(isa, threads, seq_lens, num_heads, num_kv_heads, head_dim, block_size):
    k, v, table, lens = paged_cache(seq_lens, num_kv_heads, head_dim, block_size)
    q = torch.randn(len(seq_lens), num_heads, head_dim) * 0.5
    scale = head_dim**-0.5
    out = run_attention(q, k, v, table, lens, scale)
    want = truth.attention_decode(q.double(), k.double(), v.double(), table, lens, scale)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    threads(1)
    assert torch.equal(run_attention(q, k, v, table, lens, scale), out)
    threads(2)
    # each sequence alone gives bitwise the same rows as in the batch
    for s in range(len(seq_lens)):
        alone = run_attention(q[s : s + 1].contiguous(), k, v, table[s : s + 1].contiguous(), lens[s : s + 1], scale)
        assert torch.equal(alone, out[s : s + 1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 40])  # the vector path and the generic one
def test_attention_decode_low_precision_cache(isa, dtype, head_dim):
    k, v, table, lens = paged_cache([5, 130, 70], 2, head_dim, 16)
    k, v = k.to(dtype), v.to(dtype)
    q = torch.randn(3, 6, head_dim) * 0.5
    scale = head_dim**-0.5
    out = torch.empty(3, 6, head_dim)
    cpu.attention_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lens.data_ptr(), out.data_ptr(),
                         3, 6, 2, head_dim, 16, scale, table.shape[1], 0, str(dtype).split(".")[1])
    want = truth.attention_decode(q.double(), k.double(), v.double(), table, lens, scale)  # the cached values, exactly
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    from churon.kernels import ops

    assert torch.equal(ops.attention_decode(q, k, v, table, lens, scale), out)


@pytest.mark.parametrize("head_dim", [64, 40])  # the vector path and the generic one
def test_attention_decode_int8_cache(isa, threads, head_dim):
    k, v, table, lens = paged_cache([5, 130, 70], 2, head_dim, 16)
    (k, ks), (v, vs) = quantize_int8(k), quantize_int8(v)
    q = torch.randn(3, 6, head_dim) * 0.5
    scale = head_dim**-0.5

    def run():
        out = torch.empty(3, 6, head_dim)
        cpu.attention_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lens.data_ptr(),
                             out.data_ptr(), 3, 6, 2, head_dim, 16, scale, table.shape[1], 0, "int8", ks.data_ptr(),
                             vs.data_ptr())
        return out

    out = run()
    # against exact attention over the dequantized cache
    kd, vd = k.double() * ks.double().unsqueeze(-1), v.double() * vs.double().unsqueeze(-1)
    want = truth.attention_decode(q.double(), kd, vd, table, lens, scale)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    threads(1)
    assert torch.equal(run(), out)
    with pytest.raises(ValueError, match="k_scale"):
        cpu.attention_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lens.data_ptr(),
                             q.data_ptr(), 3, 6, 2, head_dim, 16, scale, table.shape[1], 0, "int8")


class Cache:
    """A paged cache pair of one kv_dtype, with a poison block (NaN) appended: block id `poison`, what the
    table entries of blocks a row must not read point at. `kd`, `vd`: the values cached, in float64."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, kv_dtype: str):
        nan = torch.full_like(k[:1], float("nan"))
        k, v = torch.cat([k, nan]), torch.cat([v, nan])
        self.kv_dtype, self.poison, self.block_size = kv_dtype, k.shape[0] - 1, k.shape[1]
        self.scales = (0, 0)
        if kv_dtype == "int8":
            (k, ks), (v, vs) = quantize_int8(k.nan_to_num()), quantize_int8(v.nan_to_num())
            ks[-1] = vs[-1] = float("nan")
            self.ks, self.vs, self.scales = ks, vs, (ks.data_ptr(), vs.data_ptr())
            self.kd, self.vd = k.double() * ks.double().unsqueeze(-1), v.double() * vs.double().unsqueeze(-1)
        else:
            k, v = k.to(getattr(torch, kv_dtype)), v.to(getattr(torch, kv_dtype))
            self.kd, self.vd = k.double(), v.double()
        self.k, self.v = k, v

    def poisoned(self, table: torch.Tensor, lens: torch.Tensor, window: int) -> torch.Tensor:
        """table with each row's entries for the blocks wholly before its window (which it must not read)
        pointing at the poison block."""
        table = table.clone()
        for s, n in enumerate(lens.tolist()):
            table[s, : max(0, n - window) // self.block_size if window else 0] = self.poison
        return table

    def attention(self, q: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, scale: float, window: int = 0,
                  softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        out = torch.full((num_seqs, num_heads, head_dim), float("nan"))
        cpu.attention_decode(q.data_ptr(), self.k.data_ptr(), self.v.data_ptr(), table.data_ptr(), lens.data_ptr(),
                             out.data_ptr(), num_seqs, num_heads, self.k.shape[2], head_dim, self.block_size, scale,
                             table.shape[1], 0, self.kv_dtype, *self.scales, window, softcap,
                             sinks.data_ptr() if sinks is not None else 0)
        return out


# (window, softcap, sinks): a window of more than a partition, of one, of one position, of less than one, of
# more than any length; each alone, then all three
ATTN_OPTIONS = [(100, 0.0, False), (64, 0.0, False), (1, 0.0, False), (40, 0.0, False), (5000, 0.0, False),
                (0, 2.0, False), (0, 0.0, True), (70, 2.0, True)]


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("head_dim", [64, 40, 256])  # the vector path, the generic one, Gemma 3's
def test_attention_decode_window_softcap_sinks(isa, threads, kv_dtype, head_dim):
    # against exact attention with the same options, blocks before a window poisoned (NaN: one read shows);
    # thread counts and a row alone bitwise the same
    seq_lens = [1, 50, 64, 65, 129, 300, 700, 0]
    k, v, table, lens = paged_cache(seq_lens, 2, head_dim, 16)
    cache = Cache(k, v, kv_dtype)
    n = len(seq_lens)
    q = torch.randn(n, 6, head_dim, generator=torch.Generator().manual_seed(3)) * 2  # scores of a few units
    sinks = torch.linspace(-3.0, 6.0, 6)  # below and above the largest scores
    scale = head_dim**-0.5
    plain = cache.attention(q, table, lens, scale)
    for window, softcap, with_sinks in ATTN_OPTIONS:
        opts = dict(window=window, softcap=softcap, sinks=sinks if with_sinks else None)
        t = cache.poisoned(table, lens, window)
        out = cache.attention(q, t, lens, scale, **opts)
        want = truth.attention_decode(q.double(), cache.kd, cache.vd, t, lens, scale, **opts)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{opts}: {m}")
        if window >= max(seq_lens) and not softcap and not with_sinks:
            assert torch.equal(out, plain)  # a window past every length changes no bit
        threads(1)
        assert torch.equal(cache.attention(q, t, lens, scale, **opts), out)
        threads(2)
        for s in range(n):
            alone = cache.attention(q[s : s + 1].contiguous(), t[s : s + 1].contiguous(), lens[s : s + 1], scale,
                                    **opts)
            assert torch.equal(alone, out[s : s + 1]), f"{opts}: row {s} alone"


@pytest.mark.parametrize("options", [(0, 0.0, False), (100, 2.0, True)], ids=["plain", "window"])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("head_dim", [64, 40])  # the vector path and the generic one
def test_attention_decode_rows_of_one_sequence(isa, threads, kv_dtype, head_dim, options):
    # The rows of one sequence in a step (a prefill chunk, a speculative verification) read the same
    # block table and are computed together a group at a time: each must still equal exact attention
    # and be bitwise the row computed alone, whatever its group (runs longer than a group, lengths out
    # of order, a length-0 row, another sequence in between, one sharing only a prefix of the blocks).
    # With a window the rows of a group begin at different positions too, each row's table points the
    # blocks before its own window at poison, and a window can begin past another row's end.
    window, softcap, with_sinks = options
    k, v, table, _ = paged_cache([300], 2, head_dim, 16)
    _, _, other, _ = paged_cache([300], 2, head_dim, 16, seed=1)
    shared = table.clone()
    shared[0, -1] = other[0, 0]  # the same blocks but the last (a prefix-cache hit)
    lens = list(range(281, 300)) + [64, 0, 65, 300, 129, 299] + [200, 201] + [290, 291] + [5, 6] + [150, 260, 20]
    tables = [table] * 25 + [shared] * 2 + [table] * 2 + [shared] * 2 + [table] * 3
    tables[19 + 3] = other  # the 300 of the run is another sequence
    cache = Cache(k, v, kv_dtype)
    n = len(lens)
    lens = torch.tensor(lens, dtype=torch.int32)
    table = cache.poisoned(torch.cat(tables), lens, window)
    q = torch.randn(n, 4, head_dim) * 0.5  # 2 heads a KV head: a kernel's batch of items spans rows
    scale = head_dim**-0.5
    opts = dict(window=window, softcap=softcap, sinks=torch.linspace(-2.0, 2.0, 4) if with_sinks else None)

    def run(rows):
        return cache.attention(q[rows].contiguous(), table[rows].contiguous(), lens[rows].contiguous(), scale, **opts)

    out = run(list(range(n)))
    want = truth.attention_decode(q.double(), cache.kd, cache.vd, table, lens, scale, **opts)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    threads(1)
    for r in range(n):
        assert torch.equal(run([r]), out[r : r + 1]), f"row {r} alone"
    assert torch.equal(run(list(range(n))[::-1]), out.flip(0))  # other groups, the same rows


def test_attention_strided_q(isa):
    # q read straight out of a fused qkv row (q_stride = (9 + 3 + 3) * 64)
    k, v, table, lens = paged_cache([40, 3], 3, 64, 16)
    qkv = torch.randn(2, 960)
    q = qkv[:, :576].reshape(2, 9, 64)
    out = torch.empty(2, 9, 64)
    cpu.attention_decode(qkv.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lens.data_ptr(),
                         out.data_ptr(), 2, 9, 3, 64, 16, 0.125, table.shape[1], 960)
    assert torch.equal(out, run_attention(q.contiguous(), k, v, table, lens, 0.125))


def test_attention_rejects_bad_lengths():
    k, v, table, lens = paged_cache([20], 1, 16, 16)
    lens[0] = 33  # needs 3 blocks, the table has 2
    with pytest.raises(ValueError, match="does not fit"):
        run_attention(torch.randn(1, 1, 16), k, v, table, lens, 0.25)


def test_attention_rejects_bad_options():
    k, v, table, lens = paged_cache([20], 1, 16, 16)
    cache = Cache(k, v, "float32")
    q = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="window"):
        cache.attention(q, table, lens, 0.25, window=-1)
    for softcap in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            cache.attention(q, table, lens, 0.25, softcap=softcap)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pool_survives_fork(threads):
    # a forked child (e.g. a server worker) must not wait for the parent's pool threads
    threads(2)
    raw = weight_bytes(T.Q8_0, 64, 256)
    q = cpu.QMatrix(raw, int(T.Q8_0), 64, 256)
    x = activations(3, 256)
    want = matmul(q, x)
    pid = os.fork()
    if pid == 0:  # child: run parallel kernels, exit 0 if they agree
        ok = torch.equal(matmul(q, x), want) and cpu.get_num_threads() == 2
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert torch.equal(matmul(q, x), want)


# ---------------------------------------------------------------------------
# the tensor-level wrappers


def test_ops_wrappers():
    from churon.kernels import ops

    raw = weight_bytes(T.Q4_1, 40, 64)
    m = ops.QuantizedMatrix(raw, int(T.Q4_1), 40, 64)
    x = activations(2, 64)
    y = m(x)
    assert y.shape == (2, 40)
    assert torch.equal(m.dequantize(), dequantize(raw, T.Q4_1, (40, 64)))
    with pytest.raises(ValueError, match="features"):
        m(torch.zeros(1, 32))
    with pytest.raises(ValueError, match="contiguous"):
        m(torch.zeros(64, 2).T)
    w = torch.randn(64)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), truth.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    k, v, table, lens = paged_cache([3, 9], 2, 16, 4)
    q = torch.randn(2, 4, 16)
    torch.testing.assert_close(ops.attention_decode(q, k, v, table, lens, 0.25),
                               truth.attention_decode(q, k, v, table, lens, 0.25), rtol=1e-5, atol=1e-5)
    gu = activations(3, 64)
    assert torch.equal(ops.geglu(gu), ops.geglu(gu.reshape(3, 1, 64)).reshape(3, 32))
    torch.testing.assert_close(ops.geglu(gu), truth.geglu(gu), rtol=1e-5, atol=1e-6)


def test_ops_attention_decode_options():
    from churon.kernels import ops

    k, v, table, lens = paged_cache([3, 13, 30], 2, 16, 4)
    q = torch.randn(3, 4, 16)
    sinks = torch.randn(4)
    opts = dict(window=6, softcap=5.0, sinks=sinks)
    want = truth.attention_decode(q, k, v, table, lens, 0.25, **opts)
    table[1, 0] = table[2, :6] = -1  # blocks wholly before the window: never read, so not checked
    out = ops.attention_decode(q, k, v, table, lens, 0.25, **opts)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, Cache(k, v, "float32").attention(q, table, lens, 0.25, **opts))
    table[2, 6] = -1  # holds position 24, the window's first of 30 - 6
    with pytest.raises(ValueError, match="block id"):
        ops.attention_decode(q, k, v, table, lens, 0.25, **opts)
    with pytest.raises(ValueError, match="sinks"):
        ops.attention_decode(q, k, v, table, lens, 0.25, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="window"):
        ops.attention_decode(q, k, v, table, lens, 0.25, window=-2)
