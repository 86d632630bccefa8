"""Which type each tensor is written in: llama-quantize's defaults, --keep patterns, and a bits-per-weight
budget spent on the tensors whose rounding costs the most.

Defaults (llama.cpp's llama_tensor_get_type, for the types churon writes):
- 1-D tensors (norms, biases, rope_freqs) stay F32, and so do BERT's position and token-type tables
  (position_embd, token_types: llama.cpp never quantizes them) and every bias (gpt-oss's experts' are 2-D:
  llama.cpp quantizes only tensors named *weight);
- the output matrix (output.weight, or token_embd.weight when the embeddings are tied) goes to Q6_K,
  or Q8_0 when its rows are not a multiple of 256 -- unless the type is Q8_0 or a float type;
- for Q4_K and Q5_K (llama.cpp's Q4_K_M / Q5_K_M mixes) attn_v and ffn_down of the first and last
  eighth of the layers, and of every third layer between, go to Q6_K;
- a type whose block does not divide the rows falls back as llama.cpp's does: Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, then F16 if that does not fit either.
`pure` skips the second and third rule (llama-quantize --pure).

Budget (--target-bpw): starting from those choices, tensors move up a ladder of types one step at a
time, the step with the largest drop in relative output error per extra byte first, until the next
step would exceed the budget. A tensor's relative output error at a type is
    sum_j m_j ||W[:, j] - Q(W)[:, j]||^2 / sum_j m_j ||W[:, j]||^2,
m_j the calibration mean of x_j^2 of its inputs (1 for tensors no matmul reads, like token_embd):
the diagonal estimate of ||X (W - Q(W))^T||^2 / ||X W^T||^2.
"""

from __future__ import annotations

import fnmatch
import heapq
from typing import Callable, Iterable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from churon.formats.quants import dequantize, quant_type, quantize

FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})

# llama.cpp's fallback for a K type on rows that are not a multiple of 256 (convert_incompatible_tensor)
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

# 2-D tensors llama.cpp keeps F32 whatever the type (convert_hf_to_gguf's prepare_tensors, llama-quantize)
ALWAYS_F32 = frozenset({"position_embd.weight", "token_types.weight"})

# types a --target-bpw budget moves tensors up through, by bits per weight
LADDER = (T.Q4_0, T.Q4_K, T.Q5_0, T.Q5_K, T.Q6_K, T.Q8_0, T.F16)


def bits_per_weight(qtype: T) -> float:
    block, size = GGML_QUANT_SIZES[qtype]
    return size * 8 / block


def fitting_type(qtype: T, cols: int) -> T:
    """qtype, or llama.cpp's fallback when its block does not divide a row of `cols` values."""
    if cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    fallback = _FALLBACK.get(qtype, T.F16)
    return fallback if cols % GGML_QUANT_SIZES[fallback][0] == 0 else T.F16


def _use_more_bits(layer: int, n_layers: int) -> bool:
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def default_type(name: str, shape: tuple[int, ...], qtype: T, n_layers: int, tied: bool, pure: bool = False) -> T:
    """The type llama-quantize gives tensor `name` when asked for `qtype` (see the module docstring).
    tied: there is no output.weight, so token_embd takes its place (tied embeddings, or an encoder)."""
    if len(shape) < 2 or name in ALWAYS_F32 or name.endswith(".bias"):
        return T.F32
    cols = shape[-1]
    if pure or qtype in FLOAT_TYPES:
        return fitting_type(qtype, cols)
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if cols % 256 != 0:
            return T.Q8_0
        return qtype if qtype == T.Q8_0 else T.Q6_K
    parts = name.split(".")
    if qtype in (T.Q4_K, T.Q5_K) and len(parts) == 4 and parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down"):
        if _use_more_bits(int(parts[1]), n_layers):
            return fitting_type(T.Q6_K, cols)
    return fitting_type(qtype, cols)


def parse_keep(keep: Iterable[str] | dict[str, str] | None) -> list[tuple[str, T]]:
    """--keep PATTERN=TYPE items (or a {pattern: type} dict) -> [(glob pattern, type)]."""
    if keep is None:
        return []
    items = list(keep.items()) if isinstance(keep, dict) else []
    if not isinstance(keep, dict):
        for item in keep:
            pattern, sep, qtype = item.rpartition("=")
            if not sep or not pattern or not qtype:
                raise ValueError(f"--keep {item!r}: expected PATTERN=TYPE, e.g. 'output.weight=Q8_0' or 'blk.*.ffn_down.weight=Q6_K'")
            items.append((pattern, qtype))
    return [(pattern, quant_type(qtype)) for pattern, qtype in items]


def apply_keep(types: dict[str, T], shapes: dict[str, tuple[int, ...]], keep: list[tuple[str, T]]) -> set[str]:
    """Set the type of every 2-D tensor matching a pattern (the last matching pattern wins); returns their names."""
    kept = set()
    for pattern, qtype in keep:
        names = [n for n in types if len(shapes[n]) >= 2 and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise ValueError(f"--keep pattern {pattern!r} matches no 2-D tensor (names look like 'blk.0.attn_q.weight')")
        for n in names:
            types[n] = fitting_type(qtype, shapes[n][-1])
            kept.add(n)
    return kept


def relative_error(w: torch.Tensor, qtype: T, importance: torch.Tensor | None) -> float:
    """Relative output error of w written as qtype (see the module docstring), importance-weighted rounding."""
    if qtype == T.F32:
        return 0.0
    raw = quantize(w, qtype, importance)
    err = (dequantize(raw.reshape(-1), qtype, tuple(w.shape)) - w).square().sum(0, dtype=torch.float64)
    m = torch.ones(w.shape[1], dtype=torch.float64) if importance is None else importance.double()
    return float((err * m).sum() / (w.square().sum(0, dtype=torch.float64) * m).sum().clamp(min=1e-30))


def check_budget(types: dict[str, T], shapes: dict[str, tuple[int, ...]], target_bpw: float) -> None:
    """target_bpw must at least cover the types already chosen (checked before any calibration runs)."""
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    used = sum(int(np.prod(shapes[n])) // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1] for n, t in types.items())
    if not target_bpw * n_params / 8 >= used:
        raise ValueError(
            f"--target-bpw {target_bpw:g} is below the {used * 8 / n_params:.3f} bits per weight of the types"
            " chosen before the budget (raise it, or pick a smaller --type)")


def spend_budget(
    types: dict[str, T],
    shapes: dict[str, tuple[int, ...]],
    candidates: list[str],
    target_bpw: float,
    read: Callable[[str], torch.Tensor],
    importance: Callable[[str], torch.Tensor | None],
    progress: Callable[[Iterable[str]], Iterable[str]] = lambda names: names,
) -> dict[str, T]:
    """Move the `candidates` up LADDER within target_bpw bits per weight over all tensors (module docstring)."""
    check_budget(types, shapes, target_bpw)
    n_params = sum(int(np.prod(s)) for s in shapes.values())

    def n_bytes(name: str, qtype: T) -> int:
        block, size = GGML_QUANT_SIZES[qtype]
        return int(np.prod(shapes[name])) // block * size

    used = sum(n_bytes(n, t) for n, t in types.items())
    budget = target_bpw * n_params / 8
    # each candidate's error at its current type and every ladder type above it
    steps: dict[str, list[tuple[T, float]]] = {}
    for name in progress(candidates):
        w, imp, current = read(name), importance(name), types[name]
        ladder = [current] + sorted(
            {fitting_type(t, shapes[name][-1]) for t in LADDER if bits_per_weight(t) > bits_per_weight(current)},
            key=bits_per_weight)
        steps[name] = [(t, relative_error(w, t, imp)) for t in ladder]
    heap: list[tuple[float, str, int]] = []

    def push(name: str, at: int) -> None:
        if at + 1 < len(steps[name]):
            (t0, e0), (t1, e1) = steps[name][at], steps[name][at + 1]
            gain = (e0 - e1) / max(n_bytes(name, t1) - n_bytes(name, t0), 1)
            heapq.heappush(heap, (-gain, name, at))

    for name in steps:
        push(name, 0)
    out = dict(types)
    while heap:
        _, name, at = heapq.heappop(heap)
        t0, t1 = steps[name][at][0], steps[name][at + 1][0]
        extra = n_bytes(name, t1) - n_bytes(name, t0)
        if used + extra > budget:
            continue  # this step does not fit; a cheaper one of another tensor may
        used += extra
        out[name] = t1
        push(name, at + 1)
    return out
