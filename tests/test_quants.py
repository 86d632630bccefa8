"""churon.formats.quants.dequantize against the `gguf` package's numpy reference.

Tolerance: none. Both implementations follow ggml's dequantize_row_* operation for
operation (fp16 -> fp32 scale, scale products, one multiply, one add/subtract, each
rounded to float32), so the results must be equal value for value.
"""

from __future__ import annotations

import warnings
import zlib

import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from churon.errors import ModelFileError, UnsupportedModelError
from churon.formats import quants
from churon.formats.quants import MXFP4_AS_Q8_0_EXPONENTS, SUPPORTED_TYPES, as_q8_0, dequantize, mxfp4_as_q8_0

FLOAT_TYPES = [T.F32, T.F16, T.BF16]
BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = {T.Q4_K, T.Q5_K, T.Q6_K}

# byte offsets of the fp16 scale fields in each block (ggml-common.h)
FP16_FIELDS = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.MXFP4: [],  # its scale is one E8M0 byte (E8M0_FIELDS)
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def shapes_for(qtype: T) -> list[tuple[int, ...]]:
    k = 256 if qtype in K_QUANTS else 32
    return [(k,), (1, 256), (3, 512), (7, 768), (2, 3, 2 * k)]


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def quantized_bytes(qtype: T, shape: tuple[int, ...]) -> np.ndarray | None:
    """Random normal data quantized by the gguf package, or None if it cannot quantize qtype."""
    rng = rng_for("quantize", qtype.name, shape)
    data = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0)).astype(np.float32)
    if len(shape) > 1:
        data.reshape(-1, shape[-1])[0] = 0.0  # an all-zero row: the d == 0 branch
    try:
        q = gq.quantize(data, qtype)
    except NotImplementedError:
        return None
    return np.ascontiguousarray(q).reshape(-1).view(np.uint8)


# byte offsets of the E8M0 scales (a power of two, 2^(e - 127)): random below 2^120, the subnormal e = 0 and 1 included
# (above, a code of 12 overflows float32, as it does in ggml)
E8M0_FIELDS = {T.MXFP4: [0]}


def random_block_bytes(qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    """Random blocks: every code bit random, fp16 scale fields finite and of either sign, E8M0 scales finite."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    rng = rng_for("random", qtype.name, shape)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.uniform(-0.1, 0.1, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    for offset in E8M0_FIELDS.get(qtype, ()):
        blocks[:, offset] = rng.integers(0, 248, size=n_blocks, dtype=np.uint8)
        blocks[: min(2, n_blocks), offset] = np.arange(min(2, n_blocks))  # the subnormal scales, always
    return blocks.reshape(-1)


def reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    return gq.dequantize(raw.reshape(shape[:-1] + (-1,)), qtype).reshape(shape)


def check(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> None:
    before = raw.copy()
    out = dequantize(raw, qtype, shape)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == torch.float32 and tuple(out.shape) == shape and out.is_contiguous()
    want = reference(raw, qtype, shape)
    got = out.numpy()
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)  # exact, see the module docstring
    np.testing.assert_array_equal(raw, before)  # the input is never written


def test_supported_types():
    assert SUPPORTED_TYPES == frozenset(FLOAT_TYPES + BLOCK_TYPES)


@pytest.mark.parametrize("qtype", FLOAT_TYPES + BLOCK_TYPES, ids=lambda t: t.name)
def test_quantized_data_matches_gguf(qtype):
    any_quantized = False
    for shape in shapes_for(qtype):
        raw = quantized_bytes(qtype, shape)
        if raw is None:  # the gguf package cannot quantize this type (the K-quants)
            raw = random_block_bytes(qtype, shape)
        else:
            any_quantized = True
        check(raw, qtype, shape)
    if qtype not in K_QUANTS:
        assert any_quantized, f"gguf should quantize {qtype.name}"


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf(qtype):
    for shape in shapes_for(qtype):
        check(random_block_bytes(qtype, shape), qtype, shape)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_many_chunks(qtype, monkeypatch):
    # the default chunk is far larger than these tensors: force several chunks, including
    # a short last one (13 rows of 256 values = 3328 values, chunks of 512 values)
    monkeypatch.setattr(quants, "CHUNK_VALUES", 512)
    shape = (13, 256)
    check(random_block_bytes(qtype, shape), qtype, shape)


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0, T.Q4_1, T.Q6_K], ids=lambda t: t.name)
def test_read_only_memmap_input(qtype, tmp_path):
    shape = (3, 512)
    raw = quantized_bytes(qtype, shape)
    if raw is None:
        raw = random_block_bytes(qtype, shape)
    path = tmp_path / "tensor.bin"
    path.write_bytes(b"\0" * 32 + raw.tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    view = mm[32:]
    assert not view.flags.writeable
    out = dequantize(view, qtype, shape)
    np.testing.assert_array_equal(out.numpy(), reference(raw, qtype, shape))
    out.add_(1.0)  # the result is its own memory, never the read-only map
    assert out.data_ptr() != view.ctypes.data


def test_empty_tensor():
    out = dequantize(np.zeros(0, np.uint8), T.Q4_1, (0, 64))
    assert tuple(out.shape) == (0, 64) and out.dtype == torch.float32


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.IQ4_NL, T.TQ1_0], ids=lambda t: t.name)
def test_unsupported_type(qtype):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros(type_size, np.uint8)
    with pytest.raises(UnsupportedModelError) as e:
        dequantize(raw, qtype, (block_size,), name="blk.0.ffn_up.weight")
    msg = str(e.value)
    assert qtype.name in msg and "blk.0.ffn_up.weight" in msg
    for t in SUPPORTED_TYPES:
        assert t.name in msg
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        dequantize(raw, qtype, (block_size,))


def test_unknown_type_id():
    with pytest.raises(UnsupportedModelError, match="9999"):
        dequantize(np.zeros(4, np.uint8), 9999, (1,))


@pytest.mark.parametrize(
    "qtype, shape, n_bytes, expected",
    [
        (T.Q4_1, (3, 64), 100, 3 * 2 * 20),
        (T.Q4_1, (3, 64), 3 * 2 * 20 + 1, 3 * 2 * 20),
        (T.Q8_0, (2, 32), 0, 2 * 34),
        (T.F16, (5, 7), 69, 70),
        (T.Q6_K, (1, 256), 209, 210),
    ],
    ids=["short", "long", "empty", "f16", "q6_k"],
)
def test_size_mismatch(qtype, shape, n_bytes, expected):
    with pytest.raises(ModelFileError) as e:
        dequantize(np.zeros(n_bytes, np.uint8), qtype, shape, name="token_embd.weight")
    msg = str(e.value)
    assert str(expected) in msg and str(n_bytes) in msg and "token_embd.weight" in msg and qtype.name in msg


def test_row_not_multiple_of_block():
    with pytest.raises(ModelFileError, match="block size 32"):
        dequantize(np.zeros(20, np.uint8), T.Q4_1, (1, 48))
    with pytest.raises(ModelFileError, match="block size 256"):
        dequantize(np.zeros(144, np.uint8), T.Q4_K, (2, 128))


def test_mxfp4_as_q8_0_is_lossless_where_every_scale_fits_an_fp16():
    """gpt-oss's MXFP4 experts go to the native kernels as Q8_0 (codes -12..12 under an fp16 power of two): the same
    values bitwise, at every exponent an fp16 holds (2^-24, subnormal, to 2^15); a block past them: None (float32)."""
    lo, hi = MXFP4_AS_Q8_0_EXPONENTS
    shape = (hi - lo + 1, 64)
    raw = random_block_bytes(T.MXFP4, shape).reshape(-1, 17)
    raw[:, 0] = np.repeat(np.arange(lo, hi + 1, dtype=np.uint8), 2)  # every exponent, two blocks each
    q8 = mxfp4_as_q8_0(raw.reshape(-1))
    assert q8 is not None and q8.size == raw.shape[0] * 34
    np.testing.assert_array_equal(dequantize(q8, T.Q8_0, shape).numpy(), reference(raw.reshape(-1), T.MXFP4, shape))
    np.testing.assert_array_equal(dequantize(q8, T.Q8_0, shape).numpy(), dequantize(raw.reshape(-1), T.MXFP4, shape).numpy())
    for e in (lo - 1, hi + 1):
        beyond = raw.copy()
        beyond[5, 0] = e
        assert mxfp4_as_q8_0(beyond.reshape(-1)) is None


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_0, T.Q8_0])
def test_small_integer_types_as_q8_0_hold_the_same_values(qtype):
    """Q4_0 and Q5_0 blocks (every code, random fp16 scales) rewritten as Q8_0: the gguf package dequantizes both to
    the same bits; so does churon; Q8_0 stays as it is."""
    shape = (7, 768)
    raw = random_block_bytes(qtype, shape)
    q8 = as_q8_0(raw, qtype)
    assert q8.size == 7 * 768 // 32 * 34
    np.testing.assert_array_equal(reference(q8, T.Q8_0, shape), reference(raw, qtype, shape))
    np.testing.assert_array_equal(dequantize(q8, T.Q8_0, shape).numpy(), dequantize(raw, qtype, shape).numpy())
    raw.flags.writeable = False  # a GGUF's memory map: read as it is, without torch's warning about it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(as_q8_0(raw, qtype), q8)


def test_mixed_small_integer_parts_fuse_as_q8_0_bytes():
    """Gemma 3 Q4_K_M's q/k (Q5_0) and v (Q8_0) fuse into one Q8_0 matrix equal to the parts stacked; with a
    K-quant among them (no lossless common layout) the parts stay as they are, a RowStack."""
    from churon.formats.gguf import GGUFTensor
    from churon.model.weights import RowStack, concat_rows, dense

    parts = [GGUFTensor(f"p{i}", (rows, 256), t, random_block_bytes(t, (rows, 256)))
             for i, (t, rows) in enumerate([(T.Q5_0, 4), (T.Q4_0, 2), (T.Q8_0, 3)])]
    fused = concat_rows(parts)
    assert isinstance(fused, GGUFTensor) and fused.qtype == T.Q8_0 and fused.shape == (9, 256)
    assert torch.equal(dense(fused), torch.cat([dense(p) for p in parts]))
    k = GGUFTensor("k", (2, 256), T.Q4_K, random_block_bytes(T.Q4_K, (2, 256)))
    mixed = concat_rows([parts[0], k])
    assert isinstance(mixed, RowStack) and mixed.parts == (parts[0], k) and mixed.shape == (6, 256)
    assert torch.equal(dense(mixed), torch.cat([dense(parts[0]), dense(k)]))
