"""The native LoRA kernel (churon._cpu.lora_add through churon.kernels.ops, and NativeBackend.add_lora) against
its ground truth in churon.kernels.ground_truth, computed in float64, once per ISA the machine runs.

Tolerance, and why: float32 dot products over `in` (one accumulator per vector lane, then the lanes' tree) and
sums over the ranks, in another order than the float64 truth: within 1e-5 of the sum of the magnitudes of
every term, |y| + |B| @ (|scale| * (|A| @ |x|)), per output (about 80 roundings of 6e-8 at the sizes here).
Determinism: a token's row is bitwise the same alone and among 63 others of 5 slots in any order, with 1 or
2 threads.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from churon import kernels
from churon.kernels import ground_truth as truth
from churon.kernels import ops

needs_native = pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason or "no native kernels")


def gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def random_pairs(g: torch.Generator, ranks, fin: int, fout: int, parts=None):
    """Per slot (A [r, in], B [out, r]) or None (rank None); with parts (output sizes), B is block-diagonal
    over them as a fused qkv / gate_up B is, each part reading its own r // len(parts) ranks."""
    pairs = []
    for r in ranks:
        if r is None:
            pairs.append(None)
            continue
        a = torch.randn(r, fin, generator=g)
        if parts:
            b = torch.block_diag(*[torch.randn(n, r // len(parts), generator=g) for n in parts])
        else:
            b = torch.randn(fout, r, generator=g)
        pairs.append((a, b))
    return pairs


def check_against_truth(y: torch.Tensor, before: torch.Tensor, x: torch.Tensor, pairs, slots, scales) -> None:
    wide = [None if p is None else (p[0].double(), p[1].double()) for p in pairs]
    want = truth.lora_add(before.double(), x.double(), wide, slots, scales.double())
    bound = truth.lora_add(before.double().abs(), x.double().abs(),
                           [None if p is None else (p[0].abs(), p[1].abs()) for p in wide], slots, scales.double().abs())
    err = (y.double() - want).abs()
    assert bool((err <= 1e-5 * bound).all()), f"max error {float(err.max()):.3g} (bound {float(bound.max()):.3g})"
    untouched = torch.tensor([int(s) < 0 or pairs[int(s)] is None for s in slots])
    assert torch.equal(y[untouched], before[untouched])  # bitwise: no adapter, no change


# (tokens, in, out, ranks by slot (None: no pair), parts of a block-diagonal B or None)
CASES = [
    (1, 576, 960, [48], [576, 192, 192]),    # SmolLM2's qkv, one decode token
    (70, 37, 53, [5, None, 64, 1], None),     # in / out not multiples of 16, every tile tail
    (9, 17, 3, [3, None, None, 2], None),     # out below one vector
    (33, 64, 200, [None, 32, 8], [100, 100]),  # gate_up-like, a None slot first
    (64, 100, 100, [15, 3, 48, 6, None], [40, 40, 20]),  # part edges inside a 16-row group of B
]


@needs_native
@pytest.mark.parametrize("case", range(len(CASES)))
def test_lora_add_matches_ground_truth(isa, case):
    tokens, fin, fout, ranks, parts = CASES[case]
    g = gen("lora", case)
    pairs = random_pairs(g, ranks, fin, fout, parts)
    x = torch.randn(tokens, fin, generator=g)
    # y strided as a slice of linear's output may be, with its neighbours watched
    wide = torch.randn(tokens, fout + 11, generator=g)
    y = wide[:, 5 : 5 + fout]
    slots = torch.randint(-1, len(ranks), (tokens,), generator=g, dtype=torch.int32)
    scales = torch.randn(tokens, generator=g)
    scales[::7] = 0.0
    scales[1::5] = -2.5
    before, wide_before = y.clone(), wide.clone()
    ops.lora_add(y, x, ops.LoraStack(pairs), slots, scales)
    check_against_truth(y, before, x, pairs, slots, scales)
    assert torch.equal(wide[:, :5], wide_before[:, :5]) and torch.equal(wide[:, 5 + fout :], wide_before[:, 5 + fout :])


@needs_native
def test_strided_x_and_zero_blocks(isa):
    """x rows strided, and B with all-zero output blocks and an all-zero adapter (PEFT initialises B to zeros):
    those outputs get nothing, the rest what the truth says."""
    g = gen("lora", "zeros")
    pairs = random_pairs(g, [12, 12, 6], 40, 80)
    pairs[0][1][16:48] = 0.0
    pairs[1][1].zero_()
    x = torch.randn(20, 50, generator=g)[:, 3:43]
    y = torch.randn(20, 80, generator=g)
    slots = torch.tensor([0, 1, 2, -1] * 5, dtype=torch.int32)
    scales = torch.rand(20, generator=g) + 0.5
    before = y.clone()
    ops.lora_add(y, x, ops.LoraStack(pairs), slots, scales)
    check_against_truth(y, before, x, pairs, slots, scales)
    assert torch.equal(y[slots == 1], before[slots == 1])


@needs_native
def test_fused_b_skips_its_zero_blocks():
    """A block-diagonal B (q, k, v parts) is read as one band per part: each part's outputs only its ranks."""
    pairs = random_pairs(gen("lora", "bands"), [48], 576, 960, [576, 192, 192])
    assert ops.LoraStack(pairs).bands[0].tolist() == [[0, 576, 0, 16], [576, 768, 16, 32], [768, 960, 32, 48]]


def invariance_batch():
    g = gen("lora", "invariance")
    fin, fout = 200, 330
    pairs = random_pairs(g, [16, None, 48, 7, 32], fin, fout)
    pairs[2] = random_pairs(g, [48], fin, fout, [110, 110, 110])[0]
    tokens = 64
    x = torch.randn(tokens, fin, generator=g)
    y = torch.randn(tokens, fout, generator=g)
    slots = torch.tensor([s for s in (0, 1, 2, 3, 4, -1, 2, 0) for _ in range(8)], dtype=torch.int32)
    scales = torch.randn(tokens, generator=g)
    return ops.LoraStack(pairs), x, y, slots, scales


@needs_native
def test_token_alone_equals_token_in_a_shuffled_batch(isa):
    stack, x, y, slots, scales = invariance_batch()
    perm = torch.randperm(64, generator=gen("lora", "perm"))
    batched = y[perm].clone()
    ops.lora_add(batched, x[perm].contiguous(), stack, slots[perm].contiguous(), scales[perm].contiguous())
    for i, t in enumerate(perm.tolist()):
        alone = y[t : t + 1].clone()
        ops.lora_add(alone, x[t : t + 1], stack, slots[t : t + 1], scales[t : t + 1])
        assert torch.equal(alone[0], batched[i]), f"token {t} (slot {int(slots[t])}) differs alone and batched"


@needs_native
def test_thread_count_changes_no_bit(isa, threads):
    stack, x, y, slots, scales = invariance_batch()
    outs = []
    for n in (1, 2):
        threads(n)
        out = y.clone()
        ops.lora_add(out, x, stack, slots, scales)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@needs_native
def test_native_backend_add_lora():
    from churon.model.native_backend import NativeBackend

    backend = NativeBackend()
    g = gen("lora", "backend")
    pairs = random_pairs(g, [None, 8, 4], 48, 64, [32, 32])
    stack = backend.lora_stack(pairs)
    x = torch.randn(6, 48, generator=g)
    qkv = torch.randn(6, 96, generator=g)
    y = qkv[:, 16:80]
    slots = torch.tensor([2, -1, 1, 0, 1, 2], dtype=torch.int32)
    scales = torch.tensor([1.0, 1.0, 0.5, 1.0, -1.0, 2.0])
    before = y.clone()
    backend.add_lora(y, x, stack, slots, scales)
    check_against_truth(y, before, x, pairs, slots, scales)
    assert stack.nbytes >= 4 * (8 + 4) * (48 + 64)


@needs_native
def test_bad_arguments_are_clear_errors():
    g = gen("lora", "bad")
    stack = ops.LoraStack(random_pairs(g, [4, None], 16, 24))
    x, y = torch.randn(3, 16), torch.zeros(3, 24)
    slots, scales = torch.tensor([0, -1, 1], dtype=torch.int32), torch.ones(3)
    with pytest.raises(ValueError, match=r"slots\[1\] = 2 is not a slot \(-1 \.\. 1\)"):
        ops.lora_add(y, x, stack, torch.tensor([0, 2, 0], dtype=torch.int32), scales)
    with pytest.raises(ValueError, match=r"slots\[0\] = -2"):
        ops.lora_add(y, x, stack, torch.tensor([-2, 0, 0], dtype=torch.int32), scales)
    with pytest.raises(ValueError, match="16 -> 24 features"):
        ops.lora_add(y, torch.randn(3, 17), stack, slots, scales)
    with pytest.raises(ValueError, match="16 -> 24 features"):
        ops.lora_add(torch.zeros(3, 25), x, stack, slots, scales)
    with pytest.raises(ValueError, match="one row per token"):
        ops.lora_add(y, x, stack, slots[:2], scales)
    with pytest.raises(ValueError, match="slots must be torch.int32"):
        ops.lora_add(y, x, stack, slots.long(), scales)
    with pytest.raises(ValueError, match="x must be a float32"):
        ops.lora_add(y, x.double(), stack, slots, scales)
    with pytest.raises(ValueError, match=r"slot 0: A \(4, 16\) and B \(24, 5\)"):
        ops.LoraStack([(torch.randn(4, 16), torch.randn(24, 5))])
    with pytest.raises(ValueError, match="slot 1: .* do not map 16 features to 24"):
        ops.LoraStack([(torch.randn(4, 16), torch.randn(24, 4)), (torch.randn(4, 16), torch.randn(20, 4))])
    # the raw call checks the slot table too
    table = stack.table.clone()
    table[0, 2] = 0
    with pytest.raises(ValueError, match="slot 0 needs A, B and a positive rank"):
        kernels.cpu.lora_add(y.data_ptr(), 24, x.data_ptr(), 16, 3, 16, 24, slots.data_ptr(), scales.data_ptr(),
                             table.data_ptr(), 2)
    assert torch.equal(y, torch.zeros(3, 24))


@needs_native
def test_no_pairs_is_a_no_op():
    y = torch.randn(4, 8)
    before = y.clone()
    ops.lora_add(y, torch.randn(4, 6), ops.LoraStack([None, None]), torch.tensor([0, 1, -1, 0], dtype=torch.int32),
                 torch.ones(4))
    assert torch.equal(y, before)
