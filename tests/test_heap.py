"""kernels/heap.py: with glibc told to keep freed memory, the pages of an encoder layer's freed outputs (megabytes
each, of several sizes) serve the next layer's; by default many are mapped and faulted in anew (what made an
embedding model's op-by-op forward ~25% slower)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from churon.kernels.heap import USER_SETTINGS

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

PROBE = """
import resource, sys
import torch
from churon.kernels.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()  # once, then already done
def layer(x, tokens=2048, hidden=384):  # an encoder layer's outputs, each written, freed a few ops later
    qkv = torch.empty(tokens * 3 * hidden).fill_(1); attn = torch.empty(tokens * hidden).fill_(1); del qkv
    o = torch.empty(tokens * hidden).fill_(1); del attn
    h = torch.empty(tokens * hidden).fill_(1); del o
    up = torch.empty(tokens * 4 * hidden).fill_(1); act = torch.empty(tokens * 4 * hidden).fill_(1); del up
    down = torch.empty(tokens * hidden).fill_(1); del act
    out = torch.empty(tokens * hidden).fill_(1); del down, h
    return out
x = None
for _ in range(12):
    x = layer(x)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(24):
    x = layer(x)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env={**clean, **env},
                         check=True)
    return int(out.stdout.strip())


def test_freed_tensors_are_reused_instead_of_faulted_in_again():
    default, kept = page_faults("default"), page_faults("keep")
    # 24 layers of 8 outputs (3 to 12 MB, 11,000 pages a layer): by default thousands of pages faulted in a layer
    # (48,896 to 83,264 in all where this was written), kept: none to 1,536
    assert default >= 24 * 1000, default
    assert kept <= min(default // 10, 5000), (kept, default)


def test_the_environment_s_own_malloc_settings_are_left_alone():
    # whoever set glibc's malloc tuning in the environment (read at startup) chose it: not overridden
    out = subprocess.run([sys.executable, "-c", "from churon.kernels.heap import keep_freed_memory as k; print(k())"],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "MALLOC_TRIM_THRESHOLD_": "131072"})
    assert out.stdout.strip() == "False"
