// Row ops, RoPE and the KV cache, attention, LoRA: what churon._cpu exposes besides QMatrix. Arguments
// are raw addresses (Python ints from tensor.data_ptr()); the docstrings in module.cpp give the
// shapes and dtypes.
#pragma once

#include <cstdint>
#include <string>

namespace churon {

void rms_norm(uintptr_t xp, uintptr_t wp, uintptr_t outp, int64_t m, int64_t n, double eps);
// residual += x (x_norm: rms_norm(x, x_norm) instead, Gemma's norm after attention and the MLP), then
// out = rms_norm(residual, weight)
void add_rms_norm(uintptr_t rp, uintptr_t xp, uintptr_t wp, uintptr_t outp, int64_t m, int64_t n, double eps,
                  uintptr_t xnp);
void rope(uintptr_t xp, int64_t m, int64_t n_heads, int64_t head_dim, uintptr_t posp, uintptr_t cosp,
          uintptr_t sinp, int64_t row_stride);

// qkv rows [m, (H + 2 KV) * head_dim] (row_stride floats apart): with q_norm / k_norm (weights
// [head_dim]; 0: none) each q / k head RMS-normalized in place first (Qwen3, Gemma 3), then RoPE on the
// q and k heads in place, then k and v of token i copied into the paged caches at slot slot_mapping[i]
// (int64; negative: not written). Caches [num_blocks * block_size, KV, head_dim] of kv_dtype.
void rope_and_cache(uintptr_t qkvp, int64_t m, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    uintptr_t posp, uintptr_t cosp, uintptr_t sinp, uintptr_t kcp, uintptr_t vcp, uintptr_t slotp,
                    int64_t row_stride, const std::string& kv_dtype, uintptr_t ksp, uintptr_t vsp, uintptr_t qnp,
                    uintptr_t knp, double eps);

// out[m, n] = LayerNorm(x (+ residual)) * weight + bias; residual_ptr 0: none. Inputs are not written.
void layer_norm(uintptr_t xp, uintptr_t rp, uintptr_t wp, uintptr_t bp, uintptr_t outp, int64_t m, int64_t n,
                double eps);
// out[i] = GELU(x[i]) for n values; approximate "none" (erf) or "tanh"
void gelu(uintptr_t xp, uintptr_t outp, int64_t n, const std::string& approximate);

void swiglu(uintptr_t gup, uintptr_t outp, int64_t m, int64_t n);
// out[m, n] = gelu_tanh(gate) * up, gate_up [m, 2n] = [gate | up]
void geglu(uintptr_t gup, uintptr_t outp, int64_t m, int64_t n);
void softmax(uintptr_t xp, uintptr_t outp, int64_t m, int64_t n);

void attention_decode(uintptr_t qp, uintptr_t kp, uintptr_t vp, uintptr_t btp, uintptr_t slp, uintptr_t outp,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, double scale, int64_t max_blocks, int64_t q_stride,
                      const std::string& kv_dtype, uintptr_t ksp, uintptr_t vsp, int64_t window, double softcap,
                      uintptr_t sinksp);

// bidirectional attention of every row of qkv [tokens, row_stride] over the rows of its own sequence,
// sequences packed back to back (seq_starts int64 [n_seqs + 1]: 0, ..., tokens); out [tokens, heads * head_dim];
// bf16_tiles: on the AMX-BF16 tiles (bf16_tiles(), head_dim 32 or 64)
void attention_packed(uintptr_t qkvp, uintptr_t startsp, uintptr_t outp, int64_t tokens, int64_t n_seqs,
                      int64_t heads, int64_t head_dim, double scale, int64_t row_stride, bool bf16_tiles);

// LoRA, in place: y[t] += B_s (scales[t] * (A_s x[t])) for every token t whose slot s = slots[t] (int32,
// -1: none) has an adapter; the slot table's layout is in common.h (kLoraFields). x rows x_stride floats
// apart, y rows y_stride; scales float32 [tokens].
void lora_add(uintptr_t yp, int64_t y_stride, uintptr_t xp, int64_t x_stride, int64_t tokens, int64_t in,
              int64_t out, uintptr_t slotsp, uintptr_t scalesp, uintptr_t tablep, int64_t n_slots);

// bandwidth probe for benchmarks: read nbytes at ptr with all threads, `repeat` times
uint64_t read_bytes(uintptr_t p, int64_t nbytes, int64_t repeat);

}  // namespace churon
