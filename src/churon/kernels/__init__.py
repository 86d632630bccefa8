"""Compute kernels: the native CPU extension `churon._cpu`, its tensor wrappers and its ground truth.

    from churon import kernels
    if kernels.native_available():
        cpu = kernels.cpu              # the churon._cpu module (raw-pointer API, see below)
    else:
        print(kernels.reason)          # why not: not built, failed to load, ...

`churon._cpu` is built by the package build from src/churon/kernels/cpu/ (setup.py); it is
optional. churon.kernels.ground_truth states each kernel's math in plain PyTorch (what the kernels
are tested against). This package is a leaf: it imports nothing else of churon.

The raw API (all tensors float32 and C-contiguous unless said; pointers are ints from
`tensor.data_ptr()`; the caller keeps the tensors alive and correctly sized):

    isa() -> str; available_isas() -> list[str]; set_isa(name)      # 'amx' | 'avx512' | 'avx2' | 'scalar'
    set_num_threads(n); get_num_threads(); set_spin_us(us); get_spin_us()
    QMatrix(raw: uint8 buffer, qtype: int, rows, cols)               # GGUF bytes of a [rows, cols] weight;
                                                                     # qtype F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q5_K Q6_K
        .matmul(x_ptr, y_ptr, m, bias_ptr=0, precise=False)          # y[m, rows] = x[m, cols] @ W.T (+ bias);
                                                                     # precise: ~16-bit activations (hi + lo)
        .dequantize(out_ptr) / .dequantize_bf16(out_ptr)             # [rows, cols] float32 / bfloat16
        .dequantize_rows(ids_ptr, n, out_ptr)                        # embedding lookup, ids int64 [n]
        .rows .cols .qtype .layout .nbytes
    bf16_tiles_available() -> bool                                   # ISA amx, AMX-BF16 tiles, Linux's permission
    Bf16TileMatrix(raw: float32 array, rows, cols)                   # a float weight in bfloat16 for the tiles
        .matmul(x_ptr, y_ptr, m, bias_ptr=0)                         # y = bf16(x) @ bf16(W).T (+ bias), float32 sums
        .gelu_mlp(down, x_ptr, y_ptr, m, up_bias_ptr=0, down_bias_ptr=0, approximate="none")
                                                                     # y = down(gelu(x W^T + b)) + b', one pass
        .rows .cols .layout .nbytes
    rms_norm(x_ptr, weight_ptr, out_ptr, m, n, eps)
    add_rms_norm(residual_ptr, x_ptr, weight_ptr, out_ptr, m, n, eps, x_norm_ptr=0)   # residual += x (or
                                                                     # rms_norm(x, x_norm)); out = rms_norm(residual)
    rope(x_ptr, m, n_heads, head_dim, positions_ptr, cos_ptr, sin_ptr, row_stride=0)   # in place
    rope_and_cache(qkv_ptr, m, num_heads, num_kv_heads, head_dim, positions_ptr, cos_ptr, sin_ptr,
                   k_cache_ptr, v_cache_ptr, slot_mapping_ptr, row_stride=0, kv_dtype="float32",
                   k_scale_ptr=0, v_scale_ptr=0,                     # int8: scales float32 [slots, kv_heads]
                   q_norm_ptr=0, k_norm_ptr=0, eps=0.0)              # per-head RMSNorm of q,k first (both or none);
                                                                     # rope q,k in place; k,v -> cache
    layer_norm(x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, m, n, eps)   # LayerNorm(x + residual) * w + b,
                                                                     # residual_ptr 0: none; inputs not written
    gelu(x_ptr, out_ptr, n, approximate="none")                      # "none" (erf) or "tanh"
    swiglu(gate_up_ptr, out_ptr, m, n)
    geglu(gate_up_ptr, out_ptr, m, n)                                # gelu(gate, approximate="tanh") * up
    softmax(x_ptr, out_ptr, m, n)
    attention_decode(q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr,
                     num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                     max_blocks_per_seq, q_stride=0, kv_dtype="float32",  # float32/float16/bfloat16/int8
                     k_scale_ptr=0, v_scale_ptr=0, window=0, softcap=0.0,  # sliding window, soft-capping,
                     sinks_ptr=0)                                    # sinks float32 [num_heads]
    attention_packed(qkv_ptr, seq_starts_ptr, out_ptr, tokens, n_seqs, heads, head_dim, scale,
                     row_stride=0, bf16_tiles=False)                 # encoder attention over packed sequences:
                                                                     # q, k, v = qkv columns [0,H) [H,2H) [2H,3H);
                                                                     # seq_starts int64 [n_seqs + 1]; out [tokens, H];
                                                                     # bf16_tiles: on the AMX-BF16 tiles (hd 32, 64)
    lora_add(y_ptr, y_stride, x_ptr, x_stride, tokens, in_features, out_features, slots_ptr,
             scales_ptr, table_ptr, n_slots)                         # y[t] += B_s (scales[t] A_s x[t]), slots
                                                                     # int32 (-1: none); table: ops.LoraStack
    read_bytes(ptr, nbytes, repeat=1)                                # memory-bandwidth probe
    pool_stats(reset=False) -> [jobs, items, caller_items, wait_ns, long_waits, solo_jobs]

churon.kernels.ops wraps the same calls for torch tensors, with checks.

Numerics: weights are repacked at construction (16 rows interleaved, see cpu/common.h);
activations are quantized on the fly to 8 bits per 32 values (ground_truth.quantize_activations,
bitwise) and multiplied with integer dot products (AVX-512 VNNI, AVX2 maddubs, or scalar; 'amx'
is the avx512 kernels with the AMX-INT8 tiles taking a matmul's rows 16 at a time, bitwise equal to
VNNI's: an integer block sum is exact either way and the float steps are the same). Bf16TileMatrix and
attention_packed(bf16_tiles=True), an embedding model's kernels on AMX CPUs, round their inputs to bfloat16
and run on the AMX-BF16 tiles for every row count.
Every output row is computed by the same operations whatever the thread count, the rows it is
batched with (M) or the thread that runs it: results are batch-invariant and reproducible.

Threads: churon has its own pool (not OpenMP): `set_num_threads(n)` counts the calling thread;
the default is the CPUs this process may use (or CHURON_NUM_THREADS). Idle workers spin for
`get_spin_us()` (300 us; CHURON_SPIN_US) between calls, giving their CPU away between polls,
then sleep. When the workers get almost no CPU time (other processes on the cores) the caller
runs jobs alone for a while. The GIL is held during every call (calls are short).
Torch's own OpenMP threads spin after each *parallel* torch op and then compete with churon's
workers for the same cores. Measured on 2 vCPUs (SmolLM2 decode step, 3.0 ms alone): one
parallel torch op per token (x.add_ on 49152 floats) made the step 4.6 ms with 2 torch threads,
3.0 ms with 1; softmax + argmax over the vocabulary (not parallel in torch) cost nothing. So
keep parallel torch ops out of a native decode loop, or torch.set_num_threads(1) while the
native kernels do the heavy work.

Environment at import: CHURON_ISA=amx|avx512|avx2|scalar forces an ISA (a value the CPU cannot run
is reported with a warning and ignored); CHURON_NUM_THREADS; CHURON_SPIN_US.
"""

from __future__ import annotations

import warnings
from types import ModuleType

cpu: ModuleType | None
reason: str = ""

try:
    from churon import _cpu as cpu  # type: ignore[attr-defined]
except ImportError as e:  # not built (no compiler at install time) or not loadable here
    cpu = None
    reason = f"churon._cpu is not available ({e}); build it with `pip install -e .` and a C++17 compiler"
else:
    if cpu.isa_error:
        warnings.warn(f"churon: {cpu.isa_error}; using {cpu.isa()} kernels", RuntimeWarning, stacklevel=2)


def native_available() -> bool:
    """True when the native CPU kernels are importable; otherwise `reason` says why."""
    return cpu is not None


__all__ = ["cpu", "native_available", "reason"]
