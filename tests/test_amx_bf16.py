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


# ---------------------------------------------------------------------------------------------------------------
# gelu_mlp: down(gelu(up(x))) in one kernel, the activation rounded to bfloat16 for the down projection

def gelu_mlp(up, down, x: torch.Tensor, up_bias, down_bias, approximate: str = "none") -> torch.Tensor:
    y = torch.full((x.shape[0], down.rows), float("nan"))
    up.gelu_mlp(down, x.data_ptr(), y.data_ptr(), x.shape[0], up_bias.data_ptr() if up_bias is not None else 0,
                down_bias.data_ptr() if down_bias is not None else 0, approximate)
    return y


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """the spacing of bfloat16 values at |v| (8 significant bits)"""
    return torch.ldexp(torch.ones_like(v), torch.frexp(v.abs().clamp_min(1e-30))[1] - 8)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_mlp_gelu_is_within_5e_7_before_its_rounding(approximate):
    # up and down the identity, no biases: y = bfloat16(gelu(bfloat16(x))) exactly as the kernel rounds its GELU, so
    # y is the bfloat16 value nearest the exact GELU unless that lies within 5e-7 of a midpoint
    n = 64
    eye = cpu.Bf16TileMatrix(torch.eye(n).numpy(), n, n)
    x = torch.cat([torch.linspace(-9, 9, 64 * 900), torch.tensor([0.0, -0.0, 5.0, -5.0, 4.99, 100.0, -100.0] + [0.5] * 57)])
    x = x.reshape(-1, n).bfloat16().float()
    y = gelu_mlp(eye, eye, x, None, None, approximate).double()
    exact = torch.nn.functional.gelu(x.double(), approximate=approximate)
    assert bool(((y - exact).abs() <= 0.5 * bf16_ulp(exact) + 5e-7).all())
    assert torch.equal(y, y.bfloat16().double())  # the activation went to the down projection in bfloat16


def mlp_reference(w1, b1, w2, b2, x, approximate):
    """the float64 block of the bfloat16-rounded x and weights, the exact GELU unrounded, and each output's bound:
    float32 sums of the up projection (moved at most 1.13x by GELU) within 5e-7 of GELU, its bfloat16 rounding
    (2^-8 relative), float32 sums of the down projection"""
    x, w1, w2 = x.bfloat16().double(), w1.bfloat16().double(), w2.bfloat16().double()
    pre = x @ w1.T + b1.double()
    pre_err = x.shape[1] * 2**-23 * (x.abs() @ w1.abs().T + b1.double().abs())
    h = torch.nn.functional.gelu(pre, approximate=approximate)
    h_err = 2**-8 * h.abs() + 1.13 * pre_err + 5e-7
    y = h @ w2.T + b2.double()
    return y, h_err @ w2.abs().T + h.shape[1] * 2**-23 * (h.abs() @ w2.abs().T + b2.double().abs())


# hidden x intermediate: all-MiniLM-L6-v2's; an odd number of up groups, intermediate not a multiple of 32; one
# partial group each way
MLP_SHAPES = [(384, 1536), (37, 100), (5, 20)]


@pytest.mark.parametrize("hidden,inter", MLP_SHAPES)
@pytest.mark.parametrize("m", [1, 17, 33, 100, 300])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_mlp_matches_the_float64_block(threads, hidden, inter, m, approximate):
    threads(2)
    g = torch.Generator().manual_seed(hidden * 1000 + inter + m)
    w1, b1 = torch.randn(inter, hidden, generator=g) * hidden**-0.5, torch.randn(inter, generator=g)
    w2, b2 = torch.randn(hidden, inter, generator=g) * inter**-0.5, torch.randn(hidden, generator=g)
    x = torch.randn(m, hidden, generator=g)
    up, down = cpu.Bf16TileMatrix(w1.numpy(), inter, hidden), cpu.Bf16TileMatrix(w2.numpy(), hidden, inter)
    want, bound = mlp_reference(w1, b1, w2, b2, x, approximate)
    y = gelu_mlp(up, down, x, b1, b2, approximate).double()
    assert bool(((y - want).abs() <= bound).all())
    # the bound is no wider than it must be: bfloat16 activations move values by about 1e-3 here
    assert 1e-4 < float((y - want).abs().max()) < 0.5 * float(bound.max())


@pytest.mark.parametrize("n_threads", [1, 2])
def test_gelu_mlp_rows_are_the_same_alone_and_in_any_batch(threads, n_threads):
    threads(n_threads)
    hidden, inter = 64, 16 * 9 + 3
    g = torch.Generator().manual_seed(7)
    w1, b1 = torch.randn(inter, hidden, generator=g) * 0.1, torch.randn(inter, generator=g)
    w2, b2 = torch.randn(hidden, inter, generator=g) * 0.1, torch.randn(hidden, generator=g)
    x = torch.randn(300, hidden, generator=g)
    up, down = cpu.Bf16TileMatrix(w1.numpy(), inter, hidden), cpu.Bf16TileMatrix(w2.numpy(), hidden, inter)
    batch = gelu_mlp(up, down, x, b1, b2)
    for i in (0, 16, 31, 32, 150, 299):
        assert torch.equal(gelu_mlp(up, down, x[i : i + 1].contiguous(), b1, b2), batch[i : i + 1])
    assert torch.equal(gelu_mlp(up, down, x[40:60].contiguous(), b1, b2), batch[40:60])


def test_gelu_mlp_refuses_what_does_not_fit():
    up = cpu.Bf16TileMatrix(torch.randn(40, 8).numpy(), 40, 8)
    down = cpu.Bf16TileMatrix(torch.randn(8, 40).numpy(), 8, 40)
    with pytest.raises(ValueError, match="the down projection takes 8 columns, the up projection gives 40"):
        up.gelu_mlp(up, 0, 0, 1)
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', got 'sigmoid'"):
        up.gelu_mlp(down, 0, 0, 1, 0, 0, "sigmoid")
    with pytest.raises(ValueError, match="m must be >= 0"):
        up.gelu_mlp(down, 0, 0, -1)
    up.gelu_mlp(down, 0, 0, 0)  # no rows: nothing read or written
