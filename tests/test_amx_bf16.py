"""The AMX-BF16 kernels of an embedding model on AMX CPUs. The matmul (churon._cpu.Bf16TileMatrix): x and W rounded
to bfloat16 (round to nearest even), the products summed in float32, equal to a float64 product of the rounded values
within float32 summation error; a row's result is bitwise the same whatever the other rows of the call and the
thread count; shapes of any size (partial row groups, columns not a multiple of 32, any number of rows). The packed
attention (attention_packed(bf16_tiles=True)): q, k, v and the softmax weights in bfloat16, a row's result
independent of what is packed with it.

Skipped where the CPU (or Linux, or the compiler that built churon) has no AMX-BF16 tiles.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from churon import kernels
from churon.kernels import ops

cpu = kernels.cpu
pytestmark = pytest.mark.skipif(
    cpu is None or not cpu.bf16_tiles_available(),
    reason="no AMX-BF16 tiles here (CPU, Linux or compiler), or the amx ISA is not the one chosen",
)


def tile_matmul(t, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.full((x.shape[0], t.rows), float("nan"))
    t.matmul(x.data_ptr(), y.data_ptr(), x.shape[0], bias.data_ptr() if bias is not None else 0)
    return y


def reference(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 product of the bfloat16-rounded values (+ bias), and the sum of |products| each row's error scales with"""
    wb, xb = w.bfloat16().double(), x.bfloat16().double()
    y = xb @ wb.T + (bias.double() if bias is not None else 0)
    return y, xb.abs() @ wb.abs().T + (bias.double().abs() if bias is not None else 0)


# rows: one partial group, several groups with a partial last one, an odd number of groups; cols: under one
# 32-column step, a partial step, several
SHAPES = [(5, 3), (37, 70), (16 * 13 + 5, 96), (48, 384)]


@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 64, 100])
def test_matches_the_product_of_the_bfloat16_values(threads, rows, cols, m):
    threads(2)
    g = torch.Generator().manual_seed(rows * 1000 + cols * 10 + m)
    w, x, bias = torch.randn(rows, cols, generator=g), torch.randn(m, cols, generator=g), torch.randn(rows, generator=g)
    t = cpu.Bf16TileMatrix(w.numpy(), rows, cols)
    assert (t.rows, t.cols) == (rows, cols) and t.layout.startswith("BF16 AMX tiles")
    for b in (bias, None):
        y = tile_matmul(t, x, b)
        want, scale = reference(w, x, b)
        # float32 sums of cols products: within cols * 2^-24 of the sum of their magnitudes
        assert bool(((y.double() - want).abs() <= cols * 2**-23 * scale + 1e-30).all()), (rows, cols, m)


def test_inputs_are_rounded_to_nearest_even():
    # 1 + 2^-8 + 2^-10 lies between the bfloat16 values 1 and 1 + 2^-7, nearer the second: truncation would give 1
    w = torch.tensor([[1.0], [3.0]])
    x = torch.tensor([[1 + 2**-8 + 2**-10], [1 + 2**-8]])  # the second a tie: to even, 1
    y = tile_matmul(cpu.Bf16TileMatrix(w.numpy(), 2, 1), x)
    assert y.tolist() == [[1 + 2**-7, 3 * (1 + 2**-7)], [1.0, 3.0]]
    w2 = torch.tensor([[1 + 2**-8 + 2**-10]])
    assert tile_matmul(cpu.Bf16TileMatrix(w2.numpy(), 1, 1), torch.ones(1, 1)).item() == 1 + 2**-7


@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_row_is_the_same_alone_and_in_any_batch(threads, n_threads):
    threads(n_threads)
    rows, cols = 16 * 13 + 5, 384
    g = torch.Generator().manual_seed(0)
    w, x, bias = torch.randn(rows, cols, generator=g), torch.randn(300, cols, generator=g), torch.randn(rows, generator=g)
    t = cpu.Bf16TileMatrix(w.numpy(), rows, cols)
    batch = tile_matmul(t, x, bias)  # many rows: split across threads by rows
    for i in (0, 15, 16, 31, 32, 150, 299):
        assert torch.equal(tile_matmul(t, x[i : i + 1].contiguous(), bias), batch[i : i + 1])
    assert torch.equal(tile_matmul(t, x[:20].contiguous(), bias), batch[:20])  # few rows: split by groups


def test_bad_matrices_are_refused():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="float32 matrix"):
        cpu.Bf16TileMatrix(w.numpy(), 4, 9)
    with pytest.raises(ValueError, match="float32"):
        cpu.Bf16TileMatrix(w.double().numpy(), 4, 8)
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu.Bf16TileMatrix(w.T.numpy(), 8, 4)
    with pytest.raises(ValueError, match="rows and cols"):
        cpu.Bf16TileMatrix(w.numpy()[:0], 0, 8)
    t = cpu.Bf16TileMatrix(w.numpy(), 4, 8)
    with pytest.raises(ValueError, match="m must be >= 0"):
        t.matmul(0, 0, -1)
    t.matmul(0, 0, 0)  # no rows: nothing read or written


def test_only_where_the_amx_isa_is_chosen():
    before = cpu.isa()
    cpu.set_isa("avx512")
    try:
        assert not cpu.bf16_tiles_available()
        with pytest.raises(ValueError, match="no AMX-BF16 tiles"):
            cpu.Bf16TileMatrix(torch.randn(4, 8).numpy(), 4, 8)
    finally:
        cpu.set_isa(before)


def packed(lens: list[int], heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    qkv = torch.randn(sum(lens), 3 * heads * head_dim, generator=torch.Generator().manual_seed(seed))
    return qkv, torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)


def attention_reference(qkv, heads, head_dim, starts, scale):
    """float64 attention of the bfloat16-rounded q, k, v with the softmax weights rounded to bfloat16 (their sum not),
    and the bound of what one bfloat16 rounding step of each weight could move a value: 2^-8 sum p |v| / sum p"""
    width = heads * head_dim
    b = qkv.bfloat16().double()
    out, bound = torch.empty(qkv.shape[0], width, dtype=torch.float64), torch.empty(qkv.shape[0], width, dtype=torch.float64)
    bounds = starts.tolist()
    for lo, hi in zip(bounds, bounds[1:]):
        q, k, v = (b[lo:hi, i * width : (i + 1) * width].reshape(hi - lo, heads, head_dim).transpose(0, 1) for i in range(3))
        s = (q @ k.transpose(1, 2)) * scale
        p = torch.exp(s - s.amax(-1, keepdim=True))
        total = p.sum(-1, keepdim=True)
        out[lo:hi] = ((p.bfloat16().double() @ v) / total).transpose(0, 1).reshape(hi - lo, width)
        bound[lo:hi] = (2**-8 * (p @ v.abs()) / total).transpose(0, 1).reshape(hi - lo, width)
    return out, bound


@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("lens", [[5], [128], [17, 64, 3, 100], [1, 300, 33]], ids=str)
def test_packed_attention_matches_the_bfloat16_reference(threads, head_dim, lens):
    threads(2)
    heads, scale = 3, head_dim**-0.5
    qkv, starts = packed(lens, heads, head_dim, seed=sum(lens) + head_dim)
    got = ops.attention_packed(qkv, heads, head_dim, starts, scale, bf16_tiles=True).double()
    want, bound = attention_reference(qkv, heads, head_dim, starts, scale)
    err = (got - want).abs()
    # float32 sums and exponentials: most values within 1e-5; a weight whose rounding the last bit of its
    # exponential tipped moves a value by at most one bfloat16 step of it
    assert float(err.median()) < 1e-5
    assert bool((err <= bound + 1e-5).all())


@pytest.mark.parametrize("n_threads", [1, 2])
def test_packed_attention_rows_do_not_depend_on_their_neighbours(threads, n_threads):
    threads(n_threads)
    heads, head_dim, scale = 4, 32, 0.2
    lens = [40, 1, 77, 16, 130, 9]
    qkv, starts = packed(lens, heads, head_dim, seed=1)
    together = ops.attention_packed(qkv, heads, head_dim, starts, scale, bf16_tiles=True)
    for i, (lo, hi) in enumerate(zip(starts.tolist(), starts.tolist()[1:])):
        alone = ops.attention_packed(qkv[lo:hi].contiguous(), heads, head_dim, torch.tensor([0, hi - lo]), scale,
                                     bf16_tiles=True)
        assert torch.equal(alone, together[lo:hi]), lens[i]


def test_packed_attention_on_tiles_takes_head_dims_32_and_64():
    qkv, starts = packed([10], 2, 16, seed=0)
    with pytest.raises(ValueError, match="head_dim 32 or 64, not 16"):
        ops.attention_packed(qkv, 2, 16, starts, 0.25, bf16_tiles=True)
    before = cpu.isa()
    cpu.set_isa("avx512")
    try:
        qkv, starts = packed([10], 2, 32, seed=0)
        with pytest.raises(ValueError, match="no AMX-BF16 tiles"):
            ops.attention_packed(qkv, 2, 32, starts, 0.25, bf16_tiles=True)
    finally:
        cpu.set_isa(before)
