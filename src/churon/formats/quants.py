"""GGML block formats: dequantization of raw tensor bytes into float32 torch tensors.

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


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_0, 18 bytes: d (fp16) | qs[16] (4-bit codes; value j in the low nibble of
    # byte j, value j+16 in the high nibble).  x = (q - 8) * d
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:].unsqueeze(1)).view(-1, 32).view(torch.int8).sub_(8)
    out.copy_(q).mul_(d)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_1, 20 bytes: d (fp16) | m (fp16) | qs[16] (4-bit codes, packed as in
    # q4_0).  x = q * d + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:].unsqueeze(1)).view(-1, 32)
    out.copy_(q).mul_(d).add_(m)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_0, 22 bytes: d (fp16) | qh[4] (bit j of this little-endian uint32 is the
    # 5th bit of value j) | qs[16] (low 4 bits, packed as in q4_0).  x = (q - 16) * d
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:].unsqueeze(1)).view(-1, 32)
    qh = _fields(blocks[:, 2:6].unsqueeze(-1), 1).view(-1, 32)  # byte j//8, bit j%8
    q.bitwise_or_(qh.bitwise_left_shift_(4)).view(torch.int8).sub_(16)
    out.copy_(q.view(torch.int8)).mul_(d)


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
