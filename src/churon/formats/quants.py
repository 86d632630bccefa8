"""GGML block formats: dequantization of raw tensor bytes into float32 torch tensors, and quantization
of float32 rows into those bytes (llama.cpp's algorithms; see the second half of this file).

A quantized GGML tensor is a sequence of fixed-size blocks laid along its contiguous
(last) dimension. Each block holds `block_size` values in `type_size` bytes: one or two
fp16 scales followed by packed integer codes. The layouts below follow ggml-common.h;
every block function works on many blocks at once (a chunk of about a million values),
as a (n_blocks, type_size) uint8 tensor, with shifts and masks; no Python loop runs per
block.

The arithmetic repeats ggml's dequantize_row_* (and the `gguf` package's reference
numpy code) operation for operation -- scale products first, one multiply, then one add
or subtract, each rounded to float32 -- so the results are bitwise equal to theirs.
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from churon.errors import ModelFileError, UnsupportedModelError

QK_K = 256  # values per K-quant super-block

# Blocks are dequantized a chunk at a time, straight into the output tensor: the small
# integer intermediates then stay in cache and are reused, instead of costing fresh
# memory (page faults) the size of the whole tensor.
CHUNK_VALUES = 1 << 20


# ---------------------------------------------------------------------------
# field helpers: `blocks` is (n_blocks, type_size) uint8


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of every block, as float32 of shape (n_blocks, 1)."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, g, m) packed bytes -> (n, g, 2, m) uint8: the low nibbles of a group, then its high nibbles."""
    out = torch.empty(qs.shape[:-1] + (2, qs.shape[-1]), dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[..., 0, :])
    torch.bitwise_right_shift(qs, 4, out=out[..., 1, :])
    return out


def _fields(qs: torch.Tensor, bits: int) -> torch.Tensor:
    """(n, g, m) bytes -> (n, g, 8 // bits, m) uint8: bit field 0 of every byte, then field 1, ..."""
    count = 8 // bits
    out = torch.empty(qs.shape[:-1] + (count, qs.shape[-1]), dtype=torch.uint8)
    for i in range(count):  # a loop over bit positions, not over blocks
        torch.bitwise_right_shift(qs, i * bits, out=out[..., i, :])
    return out.bitwise_and_((1 << bits) - 1)


# ---------------------------------------------------------------------------
# 32-value blocks.  Each function fills `out` (n_blocks, block_size) float32 from
# `blocks` (n_blocks, type_size) uint8.


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q8_0, 34 bytes: d (fp16) | qs[32] (int8).  x = qs * d
    d = _f16(blocks, 0)
    out.copy_(blocks[:, 2:].view(torch.int8)).mul_(d)


def _q4_0_ints(blocks: torch.Tensor) -> torch.Tensor:
    # block_q4_0, 18 bytes: d (fp16) | qs[16] (4-bit codes; value j in the low nibble of
    # byte j, value j+16 in the high nibble).  x = (q - 8) * d: these int8 (q - 8)
    return _nibbles(blocks[:, 2:].unsqueeze(1)).view(-1, 32).view(torch.int8).sub_(8)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q4_0_ints(blocks)).mul_(_f16(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_1, 20 bytes: d (fp16) | m (fp16) | qs[16] (4-bit codes, packed as in
    # q4_0).  x = q * d + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:].unsqueeze(1)).view(-1, 32)
    out.copy_(q).mul_(d).add_(m)


def _q5_0_ints(blocks: torch.Tensor) -> torch.Tensor:
    # block_q5_0, 22 bytes: d (fp16) | qh[4] (bit j of this little-endian uint32 is the
    # 5th bit of value j) | qs[16] (low 4 bits, packed as in q4_0).  x = (q - 16) * d: these int8 (q - 16)
    q = _nibbles(blocks[:, 6:].unsqueeze(1)).view(-1, 32)
    qh = _fields(blocks[:, 2:6].unsqueeze(-1), 1).view(-1, 32)  # byte j//8, bit j%8
    return q.bitwise_or_(qh.bitwise_left_shift_(4)).view(torch.int8).sub_(16)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5_0_ints(blocks)).mul_(_f16(blocks, 0))


# the types whose values are small integers times the block's fp16 scale, as Q8_0's are: each block rewrites as a
# Q8_0 block of the same values (same scale, the integers as int8), so parts of these types fuse losslessly
_Q8_0_INTS = {GGMLQuantizationType.Q4_0: _q4_0_ints, GGMLQuantizationType.Q5_0: _q5_0_ints}
Q8_0_EXACT = frozenset(_Q8_0_INTS) | {GGMLQuantizationType.Q8_0}


def as_q8_0(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Blocks of a Q8_0_EXACT type as Q8_0 blocks holding the same values (dequantizing either gives the same bits)."""
    if qtype == GGMLQuantizationType.Q8_0:
        return data
    blocks = _as_byte_tensor(data).view(-1, GGML_QUANT_SIZES[qtype][1])  # a memory map's bytes, read only
    out = torch.empty(blocks.shape[0], 34, dtype=torch.uint8)
    out[:, :2] = blocks[:, :2]  # the fp16 scale, as it is
    out[:, 2:] = _Q8_0_INTS[qtype](blocks).view(torch.uint8)
    return out.numpy().reshape(-1)


# E2M1 (the OCP microscaling FP4) values by 4-bit code, doubled as ggml stores them (its scale halves them back)
_E2M1_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_mxfp4, 17 bytes (gpt-oss's experts): e (E8M0: a power of two, 2^(e - 127)) | qs[16] (4-bit E2M1 codes,
    # packed as in q4_0).  x = E2M1_DOUBLED[q] * 2^(e - 128), the float built from its bits as ggml's
    # GGML_E8M0_TO_FP32_HALF does (e < 2: the subnormals 2^-128 and 2^-127)
    e = blocks[:, :1].to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000).bitwise_left_shift(e), (e - 1).bitwise_left_shift(23))
    q = _nibbles(blocks[:, 1:].unsqueeze(1)).view(-1, 32)
    out.copy_(_E2M1_DOUBLED[q.long()]).mul_(bits.view(torch.float32))


# E8M0 exponents e whose ggml value 2^(e - 128) an fp16 holds exactly: 2^-24 (the smallest subnormal) to 2^15
MXFP4_AS_Q8_0_EXPONENTS = (104, 143)


def mxfp4_as_q8_0(data: np.ndarray) -> np.ndarray | None:
    """MXFP4 blocks (17 bytes: E8M0 e | 16 bytes of E2M1 codes) as the same values in Q8_0 blocks (34 bytes: fp16 d |
    32 int8), losslessly: ggml's doubled E2M1 values are the integers -12..12, its scale 2^(e - 128) a power of two.
    None when some block's scale is outside what an fp16 holds (MXFP4_AS_Q8_0_EXPONENTS)."""
    blocks = np.ascontiguousarray(data).reshape(-1, 17)
    k = blocks[:, 0].astype(np.int32) - 128
    lo, hi = MXFP4_AS_Q8_0_EXPONENTS
    if k.size and not (lo - 128 <= int(k.min()) and int(k.max()) <= hi - 128):
        return None
    # fp16 bits of 2^k: a normal's biased exponent, or a subnormal's one mantissa bit
    d = np.where(k >= -14, (k + 15) << 10, 1 << np.clip(k + 24, 0, 9)).astype("<u2")
    qs = blocks[:, 1:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=1)  # values j and j + 16 share byte j, as in Q4_0
    out = np.empty((blocks.shape[0], 34), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = _E2M1_DOUBLED.to(torch.int8).numpy()[codes].view(np.uint8)
    return out.reshape(-1)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_1, 24 bytes: d (fp16) | m (fp16) | qh[4] (5th bits, as in q5_0) |
    # qs[16] (low 4 bits).  x = q * d + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:].unsqueeze(1)).view(-1, 32)
    qh = _fields(blocks[:, 4:8].unsqueeze(-1), 1).view(-1, 32)
    q.bitwise_or_(qh.bitwise_left_shift_(4))
    out.copy_(q).mul_(d).add_(m)


# ---------------------------------------------------------------------------
# K-quants: 256-value super-blocks


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # 12 bytes hold eight 6-bit scales (A-H) and eight 6-bit mins (a-h):
    #   bytes 0-3   EEAAAAAA FFBBBBBB GGCCCCCC HHDDDDDD
    #   bytes 4-7   eeaaaaaa ffbbbbbb ggcccccc hhdddddd
    #   bytes 8-11  eeeeEEEE ffffFFFF ggggGGGG hhhhHHHH
    s = scales.reshape(-1, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()  # each (n, 8)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_K, 144 bytes: d (fp16) | dmin (fp16) | scales[12] (8 x 6-bit scale and
    # 6-bit min, see _k_scale_min) | qs[128] (4-bit codes).  The 256 values are 8
    # sub-blocks of 32; qs bytes 32i..32i+31 hold sub-block 2i in their low nibbles and
    # sub-block 2i+1 in their high nibbles.  x = (d * sc) * q - (dmin * mn)
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:].view(n, 4, 32)).view(n, 8, 32)
    out.view(n, 8, 32).copy_(q).mul_((d * sc).unsqueeze(-1)).sub_((dmin * mn).unsqueeze(-1))


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_K, 176 bytes: d (fp16) | dmin (fp16) | scales[12] (as q4_K) | qh[32] |
    # qs[128] (low 4 bits, packed as q4_K).  Bit i of qh byte j is the 5th bit of value j
    # of sub-block i.  x = (d * sc) * q - (dmin * mn)
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    qh = _fields(blocks[:, 16:48].unsqueeze(1), 1).view(n, 8, 32)
    q = _nibbles(blocks[:, 48:].view(n, 4, 32)).view(n, 8, 32)
    q.bitwise_or_(qh.bitwise_left_shift_(4))
    out.view(n, 8, 32).copy_(q).mul_((d * sc).unsqueeze(-1)).sub_((dmin * mn).unsqueeze(-1))


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q6_K, 210 bytes: ql[128] (low 4 bits) | qh[64] (high 2 bits) | scales[16]
    # (int8, one per 16 values) | d (fp16).  Each half of 128 values uses 64 ql bytes and
    # 32 qh bytes: values l, l+32, l+64, l+96 take the low nibble of ql[l], low nibble of
    # ql[l+32], high nibble of ql[l], high nibble of ql[l+32], and bits 0-1, 2-3, 4-5, 6-7
    # of qh[l].  x = (d * scale) * (q - 32)
    n = blocks.shape[0]
    d = _f16(blocks, 208)
    scale = blocks[:, 192:208].view(torch.int8).float()
    q = _nibbles(blocks[:, :128].view(n, 2, 64)).view(n, 8, 32)
    qh = _fields(blocks[:, 128:192].view(n, 2, 32), 2).view(n, 8, 32)
    q.bitwise_or_(qh.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    out.view(n, 16, 16).copy_(q.view(torch.int8).view(n, 16, 16)).mul_((d * scale).unsqueeze(-1))


_BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.MXFP4: _mxfp4,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}

# plain element types: the raw bytes viewed as this dtype, then widened to float32
_FLOAT_DTYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_FLOAT_DTYPES) | frozenset(_BLOCK_DEQUANTIZERS)


def dequantize(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], *, name: str | None = None
) -> torch.Tensor:
    """Dequantize a tensor's raw bytes (flat uint8, e.g. a read-only view of a memory map)
    of GGML type `qtype` into a new contiguous float32 tensor of `shape` (torch order: the
    last dimension is the contiguous one). `name` only labels error messages.
    """
    what = f"tensor {name!r}" if name is not None else "tensor"
    qtype = _check_type(qtype, what)
    shape = tuple(int(s) for s in shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_elements = int(np.prod(shape, dtype=np.int64))
    if block_size > 1 and (len(shape) == 0 or shape[-1] % block_size != 0):
        raise ModelFileError(
            f"{what} of type {qtype.name} has shape {shape}: its last dimension must be a multiple"
            f" of the {qtype.name} block size {block_size}"
        )
    expected = n_elements // block_size * type_size
    raw = np.asarray(raw)
    if raw.nbytes != expected:
        raise ModelFileError(
            f"{what} of type {qtype.name} and shape {shape} needs {expected} bytes, but {raw.nbytes} bytes were given"
        )
    if n_elements == 0:
        return torch.empty(shape, dtype=torch.float32)
    data = _as_byte_tensor(raw)
    if qtype in _FLOAT_DTYPES:
        # view + widen; F32 is copied so the result never aliases the (read-only) file map
        out = data.view(_FLOAT_DTYPES[qtype]).to(torch.float32, copy=True)
    else:
        blocks = data.view(-1, type_size)
        out = torch.empty(blocks.shape[0], block_size, dtype=torch.float32)
        step = max(1, CHUNK_VALUES // block_size)
        fill = _BLOCK_DEQUANTIZERS[qtype]
        for start in range(0, blocks.shape[0], step):  # a few large chunks, not blocks
            fill(blocks[start : start + step], out[start : start + step])
    return out.view(shape)


def _check_type(qtype: GGMLQuantizationType | int, what: str) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(int(qtype))
    except ValueError:
        qtype_name = f"unknown GGML type id {int(qtype)}"
    else:
        if qtype in SUPPORTED_TYPES:
            return qtype
        qtype_name = f"GGML type {qtype.name}"
    supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES))
    raise UnsupportedModelError(f"{what} has {qtype_name}, which churon cannot read; supported types: {supported}")


def _as_byte_tensor(raw: np.ndarray) -> torch.Tensor:
    """A flat uint8 torch tensor sharing memory with `raw` (copied only if not contiguous).

    Read-only arrays (memory maps opened "r") are wrapped without a copy: nothing here
    writes to the input, and every result is a new tensor.
    """
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.flags.writeable:
        return torch.from_numpy(raw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(raw, dtype=torch.uint8)


# ===========================================================================
# Quantization: float32 rows -> raw GGML blocks.
#
# The algorithms are llama.cpp's (ggml-quants.c): quantize_row_*_ref when no importance is
# given, quantize_row_*_impl with `quant_weights` when it is. The scale searches
# (make_qx_quants, make_qkx2_quants, make_qkx3_quants, make_qp_quants) run on every block
# of a chunk at once: their loops over candidate scales (at most 37) and over the 8 scales
# of a super-block stay, the loops over blocks become tensor operations.  Sums run in
# float32 like ggml's, but in a different order, so a block whose candidate scales tie to
# the last bit can pick another candidate than ggml does (rare; see the tests).

GROUP_MAX_EPS = 1e-15  # ggml: a group whose largest magnitude is below this is all zero


def _f32(value: float) -> float:
    """`value` rounded to float32, as C computes float constants like 0.1f * is."""
    return float(np.float32(value))


def _fp16_round(v: torch.Tensor) -> torch.Tensor:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)): the value a block stores."""
    return v.half().float()


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """(n, 1) float32 -> (n, 2) uint8, little-endian fp16."""
    return v.reshape(-1, 1).half().view(torch.uint8)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C roundf (half away from zero), exact: floor(|v| + 0.5) would round 0.49999997 up."""
    a = v.abs()
    f = a.floor()
    return torch.copysign(f + (a - f >= 0.5).float(), v)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den != 0, else 0 (ggml's `suml2 ? sumlx/suml2 : 0`)."""
    ok = den != 0
    return torch.where(ok, num / torch.where(ok, den, 1.0), 0.0)


def make_qx_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric levels -nmax..nmax-1 per row of x (n, g), the scale searched over 19 candidates
    to minimise the weighted squared error (ggml make_qx_quants, rmse_type 1).
    Returns (scale (n, 1), L (n, g) in 0..2*nmax-1); an all-zero row gets scale 0 and L 0."""
    mx = x.gather(1, x.abs().argmax(1, keepdim=True))  # the value of largest magnitude, sign kept
    zero = mx.abs() < GROUP_MAX_EPS
    mx = torch.where(zero, 1.0, mx)

    def fit(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        levels = torch.round(iscale * x).clamp_(-nmax, nmax - 1)
        wl = weights * levels
        return levels, (wl * x).sum(1, keepdim=True), (wl * levels).sum(1, keepdim=True)

    L, sumlx, suml2 = fit(-nmax / mx)
    scale = _safe_div(sumlx, suml2)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        levels, sumlx, suml2 = fit(-_f32(nmax + _f32(0.1 * step)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = torch.where(better, levels, L)
        scale = torch.where(better, _safe_div(sumlx, suml2), scale)
        best = torch.where(better, scale * sumlx, best)
    return torch.where(zero, 0.0, scale), torch.where(zero, 0.0, L + nmax)


def make_qkx_quants(
    x: torch.Tensor, nmax: int, weights: torch.Tensor, rmin: float, rdelta: float, nstep: int, v3: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Levels 0..nmax with a scale and a min per row of x (n, g): x ~ scale * L - the_min, both fitted by
    weighted least squares for each of nstep+1 candidate level assignments (ggml make_qkx2_quants, or
    make_qkx3_quants when v3: the same search, with guarded level computation).
    Returns (scale (n, 1), the_min (n, 1) >= 0, L (n, g)).

    One difference from ggml, for speed: a candidate's error is not summed value by value but taken
    from the least-squares identity  sum w (s*l + m - x)^2 = sum w x^2 - s * sum w x l - m * sum w x
    (which holds at the fitted s, m; in float64), so each candidate costs one pass fewer over the data."""
    mn = x.amin(1, keepdim=True).clamp(max=0.0)
    mx = x.amax(1, keepdim=True)
    flat = mx <= mn
    mx = torch.where(flat, mn + 1.0, mx)
    sum_w = weights.sum(1, keepdim=True).double()
    wx = weights * x
    sum_x = wx.sum(1, keepdim=True).double()
    sum_x2 = (wx * x).sum(1, keepdim=True).double()

    iscale = nmax / (mx - mn)
    scale = 1 / iscale
    L = torch.round(iscale * (x - mn)).clamp_(0, nmax)
    best = (weights * (scale * L + mn - x).square()).sum(1, keepdim=True).double()
    for step in range(nstep + 1):
        iscale = _f32(_f32(rmin + _f32(rdelta * step)) + nmax) / (mx - mn)
        v = (x - mn).mul_(iscale)
        if v3:  # mn can sit at mx, so v can be inf or nan: only positive values are rounded
            levels = torch.where(v > 0, v.clamp_(max=nmax).round_(), 0.0)
        else:
            levels = v.round_().clamp_(0, nmax)
        sum_l = (weights * levels).sum(1, keepdim=True).double()
        sum_xl = (wx * levels).sum(1, keepdim=True).double()
        sum_l2 = (weights * levels * levels).sum(1, keepdim=True).double()
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        D = torch.where(ok, D, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        positive = this_min > 0
        this_min = torch.where(positive, 0.0, this_min)
        this_scale = torch.where(positive, _safe_div(sum_xl, sum_l2), this_scale)
        err = sum_x2 - this_scale * sum_xl - this_min * sum_x
        better = ok & (err < best)
        best = torch.where(better, err, best)
        L = torch.where(better, levels, L)
        scale = torch.where(better, this_scale.float(), scale)
        mn = torch.where(better, this_min.float(), mn)
    return torch.where(flat, 0.0, scale), -mn, torch.where(flat, 0.0, L)


def make_qp_quants(x: torch.Tensor, nmax: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels 0..nmax for the non-negative values in each row of x (n, g) -- the sub-block scales or
    mins of a K-quant super-block -- with one scale, searched then refined level by level to minimise
    the weighted error (ggml make_qp_quants). Returns (scale (n, 1), L (n, g))."""
    mx = x.amax(1, keepdim=True).clamp(min=0.0)
    zero = mx < GROUP_MAX_EPS
    mx = torch.where(zero, 1.0, mx)
    iscale = nmax / mx
    L = torch.round(iscale * x)
    best = (weights * (x - L / iscale).square()).sum(1, keepdim=True)
    for step in range(-4, 5):
        if step == 0:
            continue
        candidate = _f32(_f32(0.1 * step) + nmax) / mx
        levels = torch.round(candidate * x).clamp_(max=nmax)
        mse = (weights * (x - (1 / candidate) * levels).square()).sum(1, keepdim=True)
        better = mse < best
        best = torch.where(better, mse, best)
        iscale = torch.where(better, candidate, iscale)
    L = torch.round(iscale * x).clamp_(max=nmax)
    sumlx = (weights * x * L).sum(1, keepdim=True)
    suml2 = (weights * L * L).sum(1, keepdim=True)
    for _ in range(5):  # coordinate descent, one level at a time in order, as ggml does
        for i in range(x.shape[1]):
            w, xi, li = weights[:, i : i + 1], x[:, i : i + 1], L[:, i : i + 1]
            slx = sumlx - w * xi * li
            sl2 = suml2 - w * li * li
            ok = (slx > 0) & (sl2 > 0)
            new_l = torch.round(xi * sl2 / torch.where(ok, slx, 1.0)).clamp_(max=nmax)
            slx = slx + w * xi * new_l
            sl2 = sl2 + w * new_l * new_l
            better = ok & (new_l != li) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L[:, i : i + 1] = torch.where(better, new_l, li)
            sumlx = torch.where(better, slx, sumlx)
            suml2 = torch.where(better, sl2, suml2)
    return torch.where(zero, 0.0, _safe_div(sumlx, suml2)), torch.where(zero, 0.0, L)


def _importance_weights(x: torch.Tensor, qw: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
    """ggml's per-value weight of the squared error: quant_weight * sqrt(sigma2 + x^2)."""
    return qw * (sigma2 + x * x).sqrt()


# --- packing: integer levels (float tensors holding integers) -> block bytes


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).to(torch.uint8)


def _pack_nibbles32(L: torch.Tensor) -> torch.Tensor:
    """(n, 32) levels -> (n, 16) bytes: value j in the low nibble of byte j, value j+16 in the high."""
    L = _u8(L)
    return (L[:, :16] & 0x0F) | (L[:, 16:] << 4)


def _pack_bit4_32(L: torch.Tensor) -> torch.Tensor:
    """(n, 32) 5-bit levels -> (n, 4) bytes: bit j of the little-endian uint32 is bit 4 of value j."""
    bits = (L.to(torch.int32) >> 4) & 1
    return _u8((bits.view(-1, 4, 8) << torch.arange(8, dtype=torch.int32)).sum(-1))


def _pack_k_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins (n, 8) -> the 12-byte field _k_scale_min reads."""
    ls, lm = ls.to(torch.int32), lm.to(torch.int32)
    lo = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    mid = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    hi = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return _u8(torch.cat([lo, mid, hi], dim=1))


# --- 32-value blocks.  Each function maps rows x (r, cols) float32 and optional importance
# qw (r, cols) to (r * cols // 32, type_size) uint8.


def _row_sigma2(x: torch.Tensor) -> torch.Tensor:
    """Per block (r * cols // 32, 1): the mean square of the block's whole row (ggml's *_impl)."""
    r, cols = x.shape
    return (x * x).sum(1, keepdim=True).div(cols).repeat_interleave(cols // 32, dim=0)


def _quantize_q8_0(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    # llama.cpp ignores importance for Q8_0: with 255 levels the max-based scale is already best.
    b = x.reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    q = _roundf(b * _safe_div(torch.ones_like(d), d))
    return torch.cat([_fp16_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=1)


def _quantize_symmetric32(x: torch.Tensor, qw: torch.Tensor | None, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 (nmax 8) and Q5_0 (nmax 16): scale d and levels L in 0..2*nmax-1, x ~ d * (L - nmax)."""
    b = x.reshape(-1, 32)
    if qw is None:  # quantize_row_q{4,5}_0_ref: d = max / -nmax, truncating rounding
        mx = b.gather(1, b.abs().argmax(1, keepdim=True))
        d = mx / -nmax
        L = torch.trunc(b * _safe_div(torch.ones_like(d), d) + (nmax + 0.5)).clamp_(0, 2 * nmax - 1)
        return d, L
    w = _importance_weights(b, qw.reshape(-1, 32), _row_sigma2(x))
    return make_qx_quants(b, nmax, w)


def _quantize_q4_0(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    d, L = _quantize_symmetric32(x, qw, 8)
    return torch.cat([_fp16_bytes(d), _pack_nibbles32(L)], dim=1)


def _quantize_q5_0(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    d, L = _quantize_symmetric32(x, qw, 16)
    return torch.cat([_fp16_bytes(d), _pack_bit4_32(L), _pack_nibbles32(L)], dim=1)


def _quantize_affine32(x: torch.Tensor, qw: torch.Tensor | None, nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 (nmax 15) and Q5_1 (nmax 31): scale d, min m and levels L, x ~ d * L + m."""
    b = x.reshape(-1, 32)
    if qw is None:  # quantize_row_q{4,5}_1_ref: the block's range split evenly
        mn = b.amin(1, keepdim=True)
        d = (b.amax(1, keepdim=True) - mn) / nmax
        L = torch.trunc((b - mn) * _safe_div(torch.ones_like(d), d) + 0.5).clamp_(0, nmax)
        return d, mn, L
    w = _importance_weights(b, qw.reshape(-1, 32), _row_sigma2(x))
    d, the_min, L = make_qkx_quants(b, nmax, w, -0.9, 0.05, 36, v3=True)
    return d, -the_min, L


def _quantize_q4_1(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    d, m, L = _quantize_affine32(x, qw, 15)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(m), _pack_nibbles32(L)], dim=1)


def _quantize_q5_1(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    d, m, L = _quantize_affine32(x, qw, 31)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(m), _pack_bit4_32(L), _pack_nibbles32(L)], dim=1)


# --- K-quants: 256-value super-blocks


def _quantize_k_affine(x: torch.Tensor, qw: torch.Tensor | None, nmax: int) -> tuple[torch.Tensor, ...]:
    """Q4_K (nmax 15) and Q5_K (nmax 31): per super-block d, dmin, the 12-byte scales field and
    levels L (n, 8, 32), x ~ (d * sc) * L - dmin * m in each 32-value sub-block."""
    xs = x.reshape(-1, 8, 32)
    n = xs.shape[0]
    sub = xs.reshape(-1, 32)
    if qw is None:  # quantize_row_q{4,5}_K_ref
        weights = (sub * sub).mean(1, keepdim=True).sqrt() + sub.abs()
        rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
        scales, mins, L = make_qkx_quants(sub, nmax, weights, rmin, 0.1, nstep, v3=False)
        scales, mins = scales.view(n, 8), mins.view(n, 8)
        max_scale = scales.amax(1, keepdim=True).clamp(min=0.0)
        max_min = mins.amax(1, keepdim=True).clamp(min=0.0)
        ls = torch.round(_safe_div(torch.full_like(max_scale, 63.0), max_scale) * scales).clamp_(0, 63)
        lm = torch.round(_safe_div(torch.full_like(max_min, 63.0), max_min) * mins).clamp_(0, 63)
        d, dmin = max_scale / 63, max_min / 63
    else:  # quantize_row_q{4,5}_K_impl
        sigma2 = 2 * (xs * xs).sum((1, 2)).div(256).repeat_interleave(8).unsqueeze(1)
        weights = _importance_weights(sub, qw.reshape(-1, 32), sigma2)
        scales, mins, L = make_qkx_quants(sub, nmax, weights, -0.9, 0.05, 36, v3=True)
        sw = weights.sum(1).view(n, 8)
        d, ls = make_qp_quants(scales.view(n, 8), 63, sw)
        dmin, lm = make_qp_quants(mins.view(n, 8), 63, sw)
    # the levels again, against the scales as stored (fp16 d times the 6-bit sub-block scale)
    dq = (_fp16_round(d) * ls).unsqueeze(-1)
    dm = (_fp16_round(dmin) * lm).unsqueeze(-1)
    L = L.view(n, 8, 32)
    L = torch.where(dq != 0, torch.round((xs + dm) / torch.where(dq != 0, dq, 1.0)).clamp_(0, nmax), L)
    return d, dmin, _pack_k_scales(ls, lm), L


def _quantize_q4_k(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    d, dmin, scales, L = _quantize_k_affine(x, qw, 15)
    L = _u8(L).view(-1, 4, 2, 32)  # qs byte 32i + l: sub-block 2i in the low nibble, 2i+1 in the high
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales, qs], dim=1)


def _quantize_q5_k(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    d, dmin, scales, L = _quantize_k_affine(x, qw, 31)
    L = L.to(torch.int32)
    low = (L & 0x0F).view(-1, 4, 2, 32)
    qs = _u8(low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    # bit i of qh byte j: the 5th bit of value j of sub-block i
    qh = _u8(((L >> 4) << torch.arange(8, dtype=torch.int32).view(1, 8, 1)).sum(1))
    return torch.cat([_fp16_bytes(d), _fp16_bytes(dmin), scales, qh, qs], dim=1)


def _quantize_q6_k(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    sub = x.reshape(-1, 16)
    n = sub.shape[0] // 16
    # ref: weights x^2; impl: the importance as is (llama.cpp does not mix in sigma2 here)
    scales, L = make_qx_quants(sub, 32, sub * sub if qw is None else qw.reshape(-1, 16))
    scales = scales.view(n, 16)
    max_scale = scales.gather(1, scales.abs().argmax(1, keepdim=True))
    zero = max_scale.abs() < GROUP_MAX_EPS
    iscale = -128.0 / torch.where(zero, 1.0, max_scale)
    d = torch.where(zero, 0.0, 1 / iscale)
    sc = torch.where(zero, 0.0, torch.round(iscale * scales).clamp_(max=127))
    dq = (_fp16_round(d) * sc).view(-1, 1)
    L = torch.where(dq != 0, torch.round(sub / torch.where(dq != 0, dq, 1.0)).clamp_(-32, 31) + 32, L)
    L = torch.where(zero.repeat_interleave(16, dim=0), 0.0, L)  # an all-zero super-block is all zero bytes
    L = L.to(torch.int32).view(n, 2, 4, 32)  # halves of 128 values, quarters of 32
    low = L & 0x0F
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(n, 128)
    qh = ((L >> 4) << torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(1, 1, 4, 1)).sum(2).reshape(n, 64)
    return torch.cat([_u8(ql), _u8(qh), sc.to(torch.int8).view(torch.uint8), _fp16_bytes(d)], dim=1)


_BLOCK_QUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _quantize_q8_0,
    GGMLQuantizationType.Q4_0: _quantize_q4_0,
    GGMLQuantizationType.Q4_1: _quantize_q4_1,
    GGMLQuantizationType.Q5_0: _quantize_q5_0,
    GGMLQuantizationType.Q5_1: _quantize_q5_1,
    GGMLQuantizationType.Q4_K: _quantize_q4_k,
    GGMLQuantizationType.Q5_K: _quantize_q5_k,
    GGMLQuantizationType.Q6_K: _quantize_q6_k,
}

QUANTIZE_TYPES: frozenset[GGMLQuantizationType] = frozenset(_FLOAT_DTYPES) | frozenset(_BLOCK_QUANTIZERS)


def quant_type(qtype: str | int | GGMLQuantizationType) -> GGMLQuantizationType:
    """A type churon can write, from its name ("Q4_K", case-insensitive) or GGML id."""
    try:
        found = GGMLQuantizationType[qtype.upper()] if isinstance(qtype, str) else GGMLQuantizationType(int(qtype))
    except (KeyError, ValueError):
        found = None
    if found not in QUANTIZE_TYPES:
        supported = ", ".join(t.name for t in sorted(QUANTIZE_TYPES))
        raise ValueError(f"unknown quantization type {qtype!r}; supported: {supported}")
    return found


def quantize(
    x: torch.Tensor, qtype: str | GGMLQuantizationType, importance: torch.Tensor | None = None
) -> np.ndarray:
    """float32 x [rows, cols] -> raw GGUF blocks, uint8 [rows, cols // block_size * type_size].

    importance: non-negative weights of the squared rounding error, per column [cols] or per
    value [rows, cols] (llama.cpp's imatrix `quant_weights`); None is plain round-to-nearest
    with llama.cpp's default scale search. F32/F16/BF16 and Q8_0 ignore it, as llama.cpp does.
    """
    qtype = quant_type(qtype)
    x = torch.as_tensor(x)
    if x.ndim != 2:
        raise ValueError(f"quantize expects a 2-D tensor [rows, cols], got shape {tuple(x.shape)}")
    rows, cols = x.shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block_size != 0:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block_size} values; these have {cols}")
    x = x.to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cannot quantize a tensor holding inf or nan")
    if qtype in _FLOAT_DTYPES:
        return x.to(_FLOAT_DTYPES[qtype], copy=True).contiguous().view(torch.uint8).numpy().reshape(rows, -1)
    qw = None
    if importance is not None:
        qw = torch.as_tensor(importance).to(torch.float32)
        if tuple(qw.shape) not in ((cols,), (rows, cols)):
            raise ValueError(f"importance has shape {tuple(qw.shape)}; expected [{cols}] or [{rows}, {cols}]")
        if not bool(torch.isfinite(qw).all()) or bool((qw < 0).any()):
            raise ValueError("importance must be finite and non-negative")
        qw = qw.expand(rows, cols)
    out = np.empty((rows, cols // block_size * type_size), dtype=np.uint8)
    fill = _BLOCK_QUANTIZERS[qtype]
    step = max(1, CHUNK_VALUES // 4 // cols)  # the scale searches keep a few temporaries per value
    for start in range(0, rows, step):  # a few large chunks of whole rows, not blocks
        chunk = slice(start, start + step)
        blocks = fill(x[chunk].contiguous(), None if qw is None else qw[chunk].contiguous())
        out[chunk] = blocks.numpy().reshape(-1, out.shape[1])
    return out
