"""GPTQ (Frantar et al., 2022): quantize a weight's input columns one at a time, each time moving the
error just made onto the columns not yet quantized, so that the layer's output on the calibration
inputs changes as little as possible.

For y = x W^T the output error of a weight change D over calibration inputs is tr(D H D^T), with
H = X^T X (plus a damping on the diagonal, see DAMP). With U the upper Cholesky factor of H^-1
(H^-1 = U^T U), rounding column j to q_j and updating the later columns by
-(w_j - q_j) / U_jj * U_j,later is the optimal compensation, column after column (GPTQ's update,
applied in batches of columns as its "lazy batch" does).

GGML types share one scale (and min) per block of 32 or 256 consecutive columns. The blocks' scales
are chosen first, on the original weights, by the importance-weighted block quantizer (importance:
diag(H), llama.cpp's imatrix); the columns are then rounded onto those fixed grids in decreasing
order of diag(H), the inputs with the most energy first, so that their error can still be
compensated on every other column ("act order" with "static groups", as AutoGPTQ calls it). On
SmolLM2 Q4_0 this ordering took GPTQ's mean KL from worse than imatrix's to below AWQ's (GPL-3, 4
windows: in-order groups re-scaled as they go 0.229, act order 0.134, imatrix 0.177, AWQ 0.139).

Rounding works on codes without decoding each type's scale layout here: a block's dequantized value
is offset + step * code, code an integer in [lo, hi]; dequantizing the block with every code set to
0, then to 1, gives offset and step per value (CODE_BYTES says where each type keeps its code bits),
and which bit of which byte holds which bit of which value's code is found once per type by setting
the bits one at a time and watching which value moves, and by how much. The rounded codes are then
written into the blocks, the scales left as chosen.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from churon.formats.quants import dequantize, quant_type, quantize
from churon.quantize.calibration import ActivationStats
from churon.quantize.rtn import RTNMethod
from churon.quantize.mixed import FLOAT_TYPES

# Fraction of H's mean diagonal added to its diagonal (GPTQ's percdamp, 0.01 there for ~260k calibration
# tokens). With a few thousand tokens, H's off-diagonal correlations are partly noise and GPTQ overfits
# them; on SmolLM2 Q4_0 (GPL-3, 4 windows) mean KL was 0.137 at 0.05 and 0.134 at 0.3.
DAMP = 0.3
LAZY_BATCH = 128  # columns whose updates are applied to the rest of the weight at once
ROW_CHUNK_VALUES = 1 << 22  # weights of the rows GPTQ works on at once (float64 copies: 32 MB each)


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """Upper Cholesky factor U of the damped H^-1 (float64), H^-1 = U^T U.

    Columns no calibration input ever touched (H_jj = 0) get H_jj = 1 so that H stays invertible;
    their error then costs like any other column's, and nothing is compensated onto them.
    """
    h = hessian.double().clone()
    diag = h.diagonal()
    diag[diag == 0] = 1.0
    diag += damp * diag.mean()
    l_inv = torch.linalg.solve_triangular(torch.linalg.cholesky(h), torch.eye(h.shape[0], dtype=h.dtype), upper=False)
    return torch.linalg.cholesky(l_inv.T @ l_inv, upper=True)  # (L L^T)^-1 = L^-T L^-1


# type -> (byte ranges holding low code bits, set to 0x11 (or 0x01) for code 1; byte ranges holding high
# code bits, zero for codes 0 and 1; the code range) in ggml's block layouts (ggml-common.h)
_T = GGMLQuantizationType
CODE_BYTES: dict[GGMLQuantizationType, tuple[tuple[int, int, int], tuple[int, int] | None, int, int]] = {
    _T.Q4_0: ((2, 18, 0x11), None, 0, 15),  # d, qs[16]: d * (code - 8)
    _T.Q4_1: ((4, 20, 0x11), None, 0, 15),  # d, m, qs[16]: d * code + m
    _T.Q5_0: ((6, 22, 0x11), (2, 6), 0, 31),  # d, qh[4], qs[16]
    _T.Q5_1: ((8, 24, 0x11), (4, 8), 0, 31),  # d, m, qh[4], qs[16]
    _T.Q8_0: ((2, 34, 0x01), None, -127, 127),  # d, int8 qs[32]: d * code
    _T.Q4_K: ((16, 144, 0x11), None, 0, 15),  # d, dmin, scales[12], qs[128]
    _T.Q5_K: ((48, 176, 0x11), (16, 48), 0, 31),  # d, dmin, scales[12], qh[32], qs[128]
    _T.Q6_K: ((0, 128, 0x11), (128, 192), 0, 63),  # ql[128], qh[64], int8 scales[16], d
}


def block_grid(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset, step) float64 [rows, cols]: the values raw's blocks can take are offset + step * code."""
    (lo_start, lo_end, one), high, _, _ = CODE_BYTES[qtype]
    blocks = np.array(raw, dtype=np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    blocks[:, lo_start:lo_end] = 0
    if high is not None:
        blocks[:, high[0] : high[1]] = 0
    offset = dequantize(blocks, qtype, shape).double()
    blocks[:, lo_start:lo_end] = one
    return offset, dequantize(blocks, qtype, shape).double() - offset


def _grid_code(w: torch.Tensor, offset: torch.Tensor, step: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The nearest code on the grid (0 where the block's scale is 0 and every code means the same)."""
    return torch.where(step != 0, (w - offset) / torch.where(step != 0, step, 1.0), 0.0).round().clamp(lo, hi)


@functools.cache
def code_bit_layout(qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every byte of a block that holds code bits, in order, and each of its 8 bits: the value whose
    code bit it is, and which code bit (value index [n_bytes, 8], code bit [n_bytes, 8], byte index [n_bytes])."""
    (lo_start, lo_end, _), high, _, _ = CODE_BYTES[qtype]
    block = GGML_QUANT_SIZES[qtype][0]
    sample = torch.randn(1, block, generator=torch.Generator().manual_seed(0))
    probe = np.array(quantize(sample, qtype), dtype=np.uint8).reshape(-1)
    offset, step = block_grid(probe, qtype, (1, block))
    byte_index = np.array(list(range(lo_start, lo_end)) + (list(range(*high)) if high is not None else []))
    probe[byte_index] = 0
    value = np.zeros((len(byte_index), 8), dtype=np.int64)
    code_bit = np.zeros((len(byte_index), 8), dtype=np.int64)
    for i, b in enumerate(byte_index):
        for bit in range(8):
            probe[b] = 1 << bit
            moved = (dequantize(probe, qtype, (1, block)).double() - offset)[0]
            probe[b] = 0
            j = int(moved.abs().argmax())
            value[i, bit], code_bit[i, bit] = j, round(math.log2(abs(float(moved[j] / step[0, j]))))
    pairs = set(zip(value.ravel().tolist(), code_bit.ravel().tolist()))
    if len(pairs) != value.size:  # every code bit of every value exactly once
        raise RuntimeError(f"could not map the code bits of {qtype.name} blocks")
    return value, code_bit, byte_index


def write_codes(raw: np.ndarray, qtype: GGMLQuantizationType, codes: torch.Tensor) -> np.ndarray:
    """raw's blocks with their codes replaced by codes [rows, cols] (in raw's code range; scales kept)."""
    value, code_bit, byte_index = code_bit_layout(qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.array(raw, dtype=np.uint8).reshape(-1, type_size)
    c = (codes.to(torch.int64).reshape(-1, block).numpy() & 0xFF).astype(np.uint8)  # Q8_0's signed codes: two's complement
    bits = (c[:, value] >> code_bit.astype(np.uint8)) & 1  # [n_blocks, n_bytes, 8]
    blocks[:, byte_index] = np.packbits(bits, axis=-1, bitorder="little")[..., 0]
    return blocks.reshape(np.asarray(raw).shape)


def gptq_quantize(
    w: torch.Tensor, qtype: str | GGMLQuantizationType, hessian: torch.Tensor, damp: float = DAMP
) -> np.ndarray:
    """w float32 [rows, cols] -> raw GGUF blocks [rows, cols // block * type_size], GPTQ-compensated.

    Rows are independent (each compensates its own error): they go ROW_CHUNK_VALUES values at a time,
    so the float64 working copies stay small whatever the matrix (a 49k-row embedding took 5 GB at once).
    """
    qtype = quant_type(qtype)
    if qtype in FLOAT_TYPES:
        return quantize(w, qtype)
    rows, cols = w.shape
    if cols % GGML_QUANT_SIZES[qtype][0]:
        raise ValueError(f"{cols} columns are not a multiple of {qtype.name}'s block of {GGML_QUANT_SIZES[qtype][0]}")
    h = hessian.double()
    order = torch.argsort(h.diagonal(), descending=True)  # columns by input energy, largest first
    u = inverse_hessian_factor(h[order][:, order], damp)
    importance = h.diagonal().float()
    step = max(1, ROW_CHUNK_VALUES // cols)
    return np.concatenate([_gptq_rows(w[r : r + step], qtype, importance, order, u) for r in range(0, rows, step)])


def _gptq_rows(w: torch.Tensor, qtype: GGMLQuantizationType, importance: torch.Tensor, order: torch.Tensor,
               u: torch.Tensor) -> np.ndarray:
    rows, cols = w.shape
    raw = quantize(w, qtype, importance=importance)  # the block scales, fixed from here on
    offset, step = (t[:, order] for t in block_grid(raw, qtype, (rows, cols)))
    lo, hi = CODE_BYTES[qtype][2:]
    weights = w.double()[:, order]
    codes = torch.empty(rows, cols)
    for start in range(0, cols, LAZY_BATCH):
        end = min(start + LAZY_BATCH, cols)
        errors = torch.empty(rows, end - start, dtype=torch.float64)
        for j in range(start, end):
            codes[:, j] = _grid_code(weights[:, j], offset[:, j], step[:, j], lo, hi)
            errors[:, j - start] = (weights[:, j] - offset[:, j] - step[:, j] * codes[:, j]) / u[j, j]
            weights[:, j + 1 : end] -= errors[:, j - start, None] * u[j, j + 1 : end]
        weights[:, end:] -= errors @ u[start:end, end:]
    return write_codes(raw, qtype, codes[:, torch.argsort(order)])


class GPTQMethod(RTNMethod):
    name = "gptq"
    needs_calibration = True
    needs_hessian = True

    def quantize(self, name: str, w: torch.Tensor, qtype: str, stats: ActivationStats | None) -> np.ndarray:
        if stats is None or stats.hessian is None:
            return quantize(w, qtype)
        return gptq_quantize(w, qtype, stats.hessian)
