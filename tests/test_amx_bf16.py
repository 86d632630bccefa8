"""The AMX-BF16 matmul (churon._cpu.Bf16TileMatrix, an encoder's float weights on AMX CPUs): x and W rounded to
bfloat16 (round to nearest even), the products summed in float32, equal to a float64 product of the rounded values
within float32 summation error; a row's result is bitwise the same whatever the other rows of the call and the
thread count; shapes of any size (partial row groups, columns not a multiple of 32, any number of rows).

Skipped where the CPU (or Linux, or the compiler that built churon) has no AMX-BF16 tiles.
"""

from __future__ import annotations

import pytest
import torch

from churon import kernels

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
