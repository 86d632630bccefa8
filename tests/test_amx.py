"""The AMX-INT8 matmul (ISA 'amx'): bitwise equal to the AVX-512 VNNI kernel for every weight type,
every row count and shape, and it touches tiles only in a thread that asked Linux for them.

Skipped where the CPU (or the kernel, or the compiler that built churon) has no AMX: the 'amx' ISA
is then not among cpu.available_isas().
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from gguf import GGMLQuantizationType as T

from churon import kernels

from test_kernels import QUANT_TYPES, activations, check_quant_matmul, cols_for, matmul, weight_bytes

cpu = kernels.cpu
pytestmark = pytest.mark.skipif(
    cpu is None or "amx" not in cpu.available_isas(),
    reason="no AMX-INT8 here (CPU, Linux or compiler): the amx ISA is not available",
)


@pytest.fixture
def on_isa():
    """on_isa(name, fn) runs fn with that ISA chosen; the ISA before is restored after the test."""
    before = cpu.isa()

    def run(name, fn):
        cpu.set_isa(name)
        try:
            return fn()
        finally:
            cpu.set_isa(before)

    yield run
    cpu.set_isa(before)


def both(on_isa, fn):
    return on_isa("avx512", fn), on_isa("amx", fn)


# rows: one partial group, several groups with a partial last one; cols: one unit, several
SHAPES = [(37, 1), (16 * 13 + 5, 3)]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 16, 31, 32, 33, 48, 100, 257, 600])
def test_amx_matmul_is_bitwise_the_vnni_one(on_isa, threads, qtype, m):
    threads(2)
    for rows, k in SHAPES:
        cols = cols_for(qtype, k)
        raw = weight_bytes(qtype, rows, cols)
        q = cpu.QMatrix(raw, int(qtype), rows, cols)
        x = activations(m, cols, seed=m)
        bias = torch.randn(rows)
        vnni, amx = both(on_isa, lambda: matmul(q, x))
        assert torch.equal(vnni, amx), f"{rows}x{cols}: {int((vnni != amx).sum())} values differ"
        if m in (33, 257):  # and both right, not only equal
            check_quant_matmul(qtype, raw, rows, cols, x, amx)
        vnni, amx = both(on_isa, lambda: matmul(q, x, bias))
        assert torch.equal(vnni, amx)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_amx_precise_matmul_is_bitwise_the_vnni_one(on_isa, qtype):
    # precise (the logits' hi + lo split) multiplies 2m rows: 2 x 17 = 34 take two tiles and a rest
    rows, cols, m = 37, cols_for(qtype), 17
    q = cpu.QMatrix(weight_bytes(qtype, rows, cols), int(qtype), rows, cols)
    x = activations(m, cols)

    def precise():
        y = torch.empty(m, rows)
        q.matmul(x.data_ptr(), y.data_ptr(), m, 0, True)
        return y

    vnni, amx = both(on_isa, precise)
    assert torch.equal(vnni, amx)


def test_amx_stacked_parts_are_bitwise_the_vnni_ones(on_isa):
    # a QMatrixStack's parts write at their own offsets of a wider output row (its ldy)
    cols = 512
    parts = [cpu.QMatrix(weight_bytes(t, r, cols), int(t), r, cols) for t, r in [(T.Q4_K, 40), (T.Q8_0, 24), (T.Q6_K, 8)]]
    stack = cpu.QMatrixStack(parts)
    x = activations(40, cols)

    def run():
        y = torch.full((40, stack.rows), float("nan"))
        stack.matmul(x.data_ptr(), y.data_ptr(), 40, 0)
        return y

    vnni, amx = both(on_isa, run)
    assert torch.equal(vnni, amx) and not bool(amx.isnan().any())


def test_a_row_does_not_depend_on_its_neighbours_path(on_isa, threads):
    # rows 0..31 run on tiles when M = 40 and on VNNI when M = 1: the same values either way
    threads(1)
    qtype, rows, cols = T.Q4_1, 50, 576
    q = cpu.QMatrix(weight_bytes(qtype, rows, cols), int(qtype), rows, cols)
    x = activations(40, cols)
    batch = on_isa("amx", lambda: matmul(q, x))
    for i in (0, 7, 31, 32, 39):
        assert torch.equal(on_isa("amx", lambda: matmul(q, x[i : i + 1].contiguous())), batch[i : i + 1])


def test_a_new_thread_runs_tiles(on_isa):
    # a Python thread the pool never saw: it asks for tile permission itself before its first tile
    qtype, rows, cols = T.Q8_0, 32, 256
    q = cpu.QMatrix(weight_bytes(qtype, rows, cols), int(qtype), rows, cols)
    x = activations(32, cols)
    vnni = on_isa("avx512", lambda: matmul(q, x))
    got = []
    t = threading.Thread(target=lambda: got.append(on_isa("amx", lambda: matmul(q, x))))
    t.start()
    t.join()
    assert torch.equal(got[0], vnni)


TILE_PERMISSION = """
import ctypes, torch, numpy as np
from gguf import GGMLQuantizationType as T
from churon import kernels
q = kernels.cpu.QMatrix(np.zeros(64 * 34, np.uint8), int(T.Q8_0), 64, 32)
x = torch.randn(64, 32)
y = torch.empty(64, 64)
q.matmul(x.data_ptr(), y.data_ptr(), 64, 0)
perm = ctypes.c_uint64(0)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.syscall(158, 0x1022, ctypes.byref(perm)) == 0  # arch_prctl(ARCH_GET_XCOMP_PERM)
print(kernels.cpu.isa(), (perm.value >> 18) & 1)  # XTILEDATA
"""


@pytest.mark.parametrize("isa", ["amx", "avx512"])
def test_tile_permission_is_asked_only_by_the_amx_kernels(isa):
    # Linux faults a tile instruction without the permission, so a process whose matmuls never asked
    # for it (ISA avx512) never ran one; with ISA amx the matmul's threads asked for it
    env = dict(os.environ, CHURON_ISA=isa)
    out = subprocess.run([sys.executable, "-c", TILE_PERMISSION], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [isa, "1" if isa == "amx" else "0"]


def test_amx_is_the_default_where_the_cpu_has_it():
    env = {k: v for k, v in os.environ.items() if k != "CHURON_ISA"}
    code = "from churon import kernels; print(kernels.cpu.isa())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert cpu.available_isas()[0] == "amx" and out.stdout.strip() == "amx"
