"""The encoder ops (layer_norm, add_layer_norm, gelu, attention_packed) of both backends against their
ground truth in churon.kernels.ground_truth, computed in float64; the native kernels once per ISA the
machine runs (forced with set_isa, restored after).

Tolerances, and why:
  * layer_norm: float32 sums in another order than the float64 truth, and the mean's error moves
    x - mean: 1e-5 of |w| * (|x| + |mean|) * rstd + |b| per output.
  * gelu: the kernels' erfc / exp are ~1 ulp, but float32 rounding of x / sqrt 2 (or of the tanh
    argument) is amplified where GELU is steep in relative terms (x < -1): within 3 ulp for x >= -1,
    5e-6 relative + 5e-8 absolute everywhere (below x = -5.66 the erf kernel returns 0 for values
    under 4.4e-8, as torch's float32 GELU does from x = -5.5).
  * attention_packed: float32 dot products, the kernels' exp (~2 ulp): 1e-5, as attention_decode.
Determinism: a sequence's rows are bitwise the same alone and packed among others, with 1 or 2 threads.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from churon import kernels
from churon.kernels import ground_truth as truth
from churon.kernels import ops
from churon.model.reference_backend import ReferenceBackend

cpu = kernels.cpu
ISAS = cpu.available_isas() if cpu is not None else []
needs_native = pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason or "no native kernels")


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))



def backends():
    from churon.model.native_backend import NativeBackend

    return [ReferenceBackend()] + ([NativeBackend()] if kernels.native_available() else [])


# ---------------------------------------------------------------------------
# layer_norm, add_layer_norm

LN_SHAPES = [(1, 384), (3, 100), (5, 7), (70, 576)]  # n not a multiple of 16; the last runs in parallel


def ln_inputs(m: int, n: int):
    g = gen("ln", m, n)
    x = torch.randn(m, n, generator=g) * 3 + torch.randn(m, 1, generator=g) * 5  # a mean away from 0
    return x, torch.randn(n, generator=g), torch.randn(n, generator=g)


def assert_ln_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> None:
    xd = x.double()
    want = truth.layer_norm(xd, w.double(), b.double(), eps)
    mean = xd.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt((xd - mean).pow(2).mean(-1, keepdim=True) + eps)
    tol = 1e-5 * (w.double().abs() * (xd.abs() + mean.abs()) * rstd + b.double().abs())
    err = (out.double() - want).abs()
    assert bool((err <= tol).all()), f"worst err/tol {float((err / tol).max()):.3g}"


@pytest.mark.parametrize("m,n", LN_SHAPES)
def test_layer_norm(isa, threads, m, n):
    x, w, b = ln_inputs(m, n)
    out = ops.layer_norm(x, w, b, 1e-12)
    assert_ln_close(out, x, w, b, 1e-12)
    threads(1)
    assert torch.equal(ops.layer_norm(x, w, b, 1e-12), out)
    threads(2)
    assert torch.equal(ops.layer_norm(x[m - 1 :].clone(), w, b, 1e-12), out[m - 1 :])  # a row alone
    inplace = x.clone()
    ops.layer_norm(inplace, w, b, 1e-12, out=inplace)
    assert torch.equal(inplace, out)


@pytest.mark.parametrize("m,n", LN_SHAPES)
def test_add_layer_norm(isa, m, n):
    x, w, b = ln_inputs(m, n)
    residual = torch.randn(m, n, generator=gen("residual", m, n))
    before_x, before_r = x.clone(), residual.clone()
    out = ops.add_layer_norm(residual, x, w, b, 1e-5)
    assert torch.equal(x, before_x) and torch.equal(residual, before_r)
    # one float32 add per element, then the same normalization as layer_norm
    assert torch.equal(out, ops.layer_norm(residual + x, w, b, 1e-5))
    assert_ln_close(out, residual + x, w, b, 1e-5)


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
def test_backend_layer_norms(backend):
    x, w, b = ln_inputs(9, 100)
    residual = torch.randn(9, 100, generator=gen("backend residual"))
    before_x, before_r = x.clone(), residual.clone()
    assert_ln_close(backend.layer_norm(x, w, b, 1e-12), x, w, b, 1e-12)
    assert_ln_close(backend.add_layer_norm(residual, x, w, b, 1e-12), residual + x, w, b, 1e-12)
    assert torch.equal(x, before_x) and torch.equal(residual, before_r)


# ---------------------------------------------------------------------------
# gelu

def gelu_inputs() -> torch.Tensor:
    grid = torch.linspace(-12, 12, 48001)  # 48001: not a multiple of any vector width, runs in parallel
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 100.0, -100.0, 0.9277 * 2**0.5, -4 * 2**0.5])
    return torch.cat([grid, special, torch.randn(999, generator=gen("gelu")) * 3])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(isa, threads, approximate):
    x = gelu_inputs()
    out = ops.gelu(x, approximate)
    want = truth.gelu(x.double(), approximate)
    err = (out.double() - want).abs()
    ulp = torch.from_numpy(np.spacing(want.abs().float().numpy())).double()
    assert float((err / ulp)[x >= -1].max()) <= 3
    assert bool((err <= 5e-6 * want.abs() + 5e-8).all())
    threads(1)
    assert torch.equal(ops.gelu(x, approximate), out)
    threads(2)
    # an element's result depends on its value only, not on where it sits (vector tails included)
    for i in (0, 5, 47999, x.numel() - 1):
        assert torch.equal(ops.gelu(x[i : i + 1].clone(), approximate), out[i : i + 1])
    assert torch.equal(ops.gelu(x[3:20].clone(), approximate), out[3:20])


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        ops.gelu(torch.zeros(4), "sigmoid")


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_backend_gelu(backend, approximate):
    x = gelu_inputs().reshape(-1, 290)  # rows of 290: not a multiple of 16
    want = truth.gelu(x.double(), approximate)
    torch.testing.assert_close(backend.gelu(x, approximate).double(), want, rtol=5e-6, atol=2e-6)


# ---------------------------------------------------------------------------
# attention_packed


def packed(lens: list[int], heads: int, head_dim: int, extra_cols: int = 0, key=0):
    """qkv [sum(lens), 3H + extra_cols] (a strided view when extra_cols) and seq_starts."""
    g = gen("qkv", tuple(lens), heads, head_dim, extra_cols, key)
    width = 3 * heads * head_dim
    qkv = torch.randn(sum(lens), width + extra_cols, generator=g)[:, :width] if extra_cols else \
        torch.randn(sum(lens), width, generator=g)
    starts = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int64)
    return qkv, starts


CONFIGS = [
    ([64], 12, 32),  # all-MiniLM-L6-v2's heads
    ([1, 17, 300, 1, 45], 12, 32),  # 1-token sequences, 300 rows = 5 query blocks, the last partial
    ([5, 64, 33], 12, 64),
    ([130, 1], 4, 128),
    ([19, 3], 2, 256),
    ([40, 7], 3, 40),  # not a multiple of 16: the AVX-512 copy's generic path, AVX2's vector one
    ([9], 1, 20),  # and one no vector width divides
]


@pytest.mark.parametrize("lens,heads,head_dim", CONFIGS)
def test_attention_packed(isa, threads, lens, heads, head_dim):
    qkv, starts = packed(lens, heads, head_dim, extra_cols=5)
    scale = head_dim**-0.5
    out = ops.attention_packed(qkv, heads, head_dim, starts, scale)
    want = truth.attention_packed(qkv.double(), heads, head_dim, starts, scale)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    threads(1)
    assert torch.equal(ops.attention_packed(qkv, heads, head_dim, starts, scale), out)
    threads(2)
    assert torch.equal(ops.attention_packed(qkv.contiguous(), heads, head_dim, starts, scale), out)


@pytest.mark.parametrize("target", [1, 45, 300])
def test_attention_packed_batch_invariant(isa, threads, target):
    """A sequence's rows are bitwise the same alone and packed among 31 others of other lengths, at
    any place in the batch, with 1 or 2 threads."""
    heads, head_dim = 12, 32
    alone_qkv, _ = packed([target], heads, head_dim, key="target")
    alone = ops.attention_packed(alone_qkv, heads, head_dim, torch.tensor([0, target]), 0.17)
    rng = np.random.default_rng(target)
    others = [int(n) for n in rng.integers(1, 200, size=31) if n != target]
    for place in (0, 15, len(others)):
        lens = others[:place] + [target] + others[place:]
        qkv, starts = packed(lens, heads, head_dim, key=place)
        a = int(starts[place])
        qkv[a : a + target] = alone_qkv
        for n in (1, 2):
            threads(n)
            out = ops.attention_packed(qkv, heads, head_dim, starts, 0.17)
            assert torch.equal(out[a : a + target], alone)


def test_attention_packed_edges(isa):
    qkv, starts = packed([3, 4], 2, 16)
    empty_seq = torch.tensor([0, 3, 3, 7])  # an empty sequence owns no rows
    assert torch.equal(ops.attention_packed(qkv, 2, 16, empty_seq, 0.25), ops.attention_packed(qkv, 2, 16, starts, 0.25))
    out = ops.attention_packed(torch.zeros(0, 96), 2, 16, torch.tensor([0]), 0.25)
    assert out.shape == (0, 32)
    one, _ = packed([1], 2, 16)  # a lone token attends to itself alone: out = v
    assert torch.equal(ops.attention_packed(one, 2, 16, torch.tensor([0, 1]), 0.25), one[:, 64:])


BAD_STARTS = [
    (torch.tensor([0, 5, 3, 7]), "must not decrease"),
    (torch.tensor([0, 3, 6]), "from 0 to the 7 tokens"),
    (torch.tensor([1, 3, 7]), "from 0 to the 7 tokens"),
    (torch.tensor([0, 3, 7], dtype=torch.int32), "int64"),
    (torch.tensor([[0, 7]]), "1-D"),
]


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("starts,message", BAD_STARTS)
def test_attention_packed_rejects_bad_seq_starts(backend, starts, message):
    qkv, _ = packed([3, 4], 2, 16)
    with pytest.raises(ValueError, match=message):
        backend.attention_packed(qkv, 2, 16, starts, 0.25)


@needs_native
def test_attention_packed_argument_checks():
    qkv, starts = packed([3, 4], 2, 16)
    with pytest.raises(ValueError, match="columns"):
        ops.attention_packed(qkv[:, :90], 2, 16, starts, 0.25)
    with pytest.raises(ValueError, match="float32"):
        ops.attention_packed(qkv.double(), 2, 16, starts, 0.25)
    # the raw call guards its pointers on its own
    bad = torch.tensor([0, 5, 3, 7])
    out = torch.empty(7, 32)
    with pytest.raises(ValueError, match="decreases"):
        cpu.attention_packed(qkv.data_ptr(), bad.data_ptr(), out.data_ptr(), 7, 3, 2, 16, 0.25)
    with pytest.raises(ValueError, match="row_stride"):
        cpu.attention_packed(qkv.data_ptr(), starts.data_ptr(), out.data_ptr(), 7, 2, 2, 16, 0.25, 50)


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
def test_backend_attention_packed(backend):
    qkv, starts = packed([1, 17, 64, 2], 12, 32, extra_cols=3)
    out = backend.attention_packed(qkv, 12, 32, starts, 32**-0.5)
    want = truth.attention_packed(qkv.double(), 12, 32, starts, 32**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# the float32-weight matmul an HF safetensors BERT runs on


@needs_native
def test_f32_linear_batch_invariant(isa, threads):
    from churon.model.native_backend import NativeBackend

    backend = NativeBackend()
    g = gen("linear")
    for rows, cols in [(1152, 384), (384, 1536), (37, 100)]:
        w = backend.matrix(torch.randn(rows, cols, generator=g) * 0.05)
        bias = torch.randn(rows, generator=g)
        x = torch.randn(37, cols, generator=g)
        threads(2)
        batch = backend.linear(w, x, bias)
        for i in (0, 17, 36):
            assert torch.equal(backend.linear(w, x[i : i + 1], bias), batch[i : i + 1])
        threads(1)
        assert torch.equal(backend.linear(w, x, bias), batch)
