// DecoderStack (see decoder.h): a decoder's layers in one call, on the per-op path's own functions.

#include "decoder.h"

#include <stdexcept>
#include <string>

#include "isa.h"
#include "ops.h"

namespace churon {
namespace {

uintptr_t addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

float* floats(Buffer& buf, int64_t n) {
  buf.reserve(size_t(n) * 4 + 64);
  return reinterpret_cast<float*>(buf.p);
}

}  // namespace

void Linear::operator()(const float* x, float* y, int64_t m, const float* bias) const {
  if (matrix)
    matrix->matmul(addr(x), addr(y), m, addr(bias), false);
  else
    stack->matmul(addr(x), addr(y), m, addr(bias));
}

DecoderStack::DecoderStack(QMatrix& embed, const float* final_norm, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, double eps, double attn_scale, double attn_softcap, double embed_scale,
                           bool gelu_tanh, bool head_norms, int64_t moe_k, bool moe_normalize)
    : embed_(&embed),
      final_norm_(ptr<const float>(addr(final_norm), "DecoderStack: final_norm")),
      hidden_(embed.cols()),
      heads_(heads),
      kv_heads_(kv_heads),
      head_dim_(head_dim),
      eps_(eps),
      attn_scale_(attn_scale),
      attn_softcap_(attn_softcap),
      embed_scale_(embed_scale),
      gelu_tanh_(gelu_tanh),
      head_norms_(head_norms),
      moe_k_(moe_k),
      moe_normalize_(moe_normalize) {
  if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0)
    throw std::invalid_argument("DecoderStack: heads must be a positive multiple of kv_heads, head_dim positive");
}

void DecoderStack::add_layer(const DecoderLayer& layer) {
  const std::string at = "DecoderStack: layer " + std::to_string(layers_.size()) + ": ";
  const int64_t qkv_rows = (heads_ + 2 * kv_heads_) * head_dim_;
  if (layer.qkv.rows() != qkv_rows || layer.qkv.cols() != hidden_)
    throw std::invalid_argument(at + "qkv must be " + std::to_string(qkv_rows) + " x " + std::to_string(hidden_));
  if (layer.o.rows() != hidden_ || layer.o.cols() != heads_ * head_dim_)
    throw std::invalid_argument(at + "o must be " + std::to_string(hidden_) + " x " + std::to_string(heads_ * head_dim_));
  const bool moe = layer.experts != nullptr;
  if (moe ? !layer.router || layer.experts->hidden() != hidden_
          : layer.gate_up.cols() != hidden_ || layer.down.rows() != hidden_ || layer.gate_up.rows() != 2 * layer.down.cols())
    throw std::invalid_argument(at + "its MLP's shapes do not fit a hidden size of " + std::to_string(hidden_));
  if (moe && (moe_k_ < 1 || moe_k_ > layer.experts->num_experts()))
    throw std::invalid_argument(at + "top k " + std::to_string(moe_k_) + " is not in [1, experts]");
  if (!layer.input_norm || !layer.post_norm || !layer.cos || !layer.sin)
    throw std::invalid_argument(at + "its norms and RoPE tables are needed");
  if ((layer.q_norm == nullptr) != (layer.k_norm == nullptr))
    throw std::invalid_argument(at + "give both q_norm and k_norm, or neither");
  if (layer.window < 0) throw std::invalid_argument(at + "window must be >= 0");
  layers_.push_back(layer);
}

void DecoderStack::forward(const int64_t* ids, const int64_t* positions, int64_t tokens, const KvView& kv,
                           const int64_t* rows, int64_t n_rows, float* out) {
  if (layers_.empty()) throw std::invalid_argument("DecoderStack: no layers");
  if (tokens <= 0) throw std::invalid_argument("DecoderStack: a step needs at least one token");
  if (n_rows < 0) throw std::invalid_argument("DecoderStack: n_rows must be >= 0");
  const int64_t n = tokens, d = hidden_;
  float* x = floats(x_, n * d);  // the residual stream
  float* h = floats(h_, n * d);  // x after the next norm
  embed_->dequantize_rows(addr(ids), n, addr(x));
  if (embed_scale_ != 0.0) {  // torch's x *= scale: the scalar as float32, one rounding
    const float s = float(embed_scale_);
    for (int64_t i = 0; i < n * d; ++i) x[i] *= s;
  }
  rms_norm(addr(x), addr(layers_[0].input_norm), addr(h), n, d, eps_);
  const int64_t last = num_layers() - 1;
  for (int64_t i = 0; i <= last; ++i) {
    layer_step(i, positions, n, kv);
    if (i < last)  // the MLP's residual add (Gemma: its norm first) fused with the next input norm
      add_rms_norm(addr(x), addr(down_.p), addr(layers_[i + 1].input_norm), addr(h), n, d, eps_,
                   addr(layers_[i].mlp_out_norm));
  }
  // the rows asked for: their residual and MLP output side by side, then the final norm
  float* rx = floats(last_, 2 * n_rows * d);
  float* rd = rx + n_rows * d;
  const float* down = reinterpret_cast<const float*>(down_.p);
  for (int64_t r = 0; r < n_rows; ++r) {
    if (rows[r] < 0 || rows[r] >= n)
      throw std::out_of_range("DecoderStack: row " + std::to_string(rows[r]) + " is outside the step's " +
                              std::to_string(n) + " tokens");
    std::memcpy(rx + r * d, x + rows[r] * d, size_t(d) * 4);
    std::memcpy(rd + r * d, down + rows[r] * d, size_t(d) * 4);
  }
  add_rms_norm(addr(rx), addr(rd), addr(final_norm_), addr(out), n_rows, d, eps_, addr(layers_[last].mlp_out_norm));
}

void DecoderStack::layer_step(int64_t i, const int64_t* positions, int64_t n, const KvView& kv) {
  const DecoderLayer& L = layers_[i];
  const int64_t d = hidden_, q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  const int64_t qkv_rows = q_size + 2 * kv_size;
  float* x = reinterpret_cast<float*>(x_.p);
  float* h = reinterpret_cast<float*>(h_.p);
  float* qkv = floats(qkv_, n * qkv_rows);
  L.qkv(h, qkv, n, L.qkv_bias);
  const bool per_head = L.q_norm && head_norms_;
  if (L.q_norm && !head_norms_) {  // OLMoE: over all of q and all of k, each token's row on its own
    const KernelTable* k = kt();
    for (int64_t t = 0; t < n; ++t) {
      float* row = qkv + t * qkv_rows;
      k->rms_norm(row, L.q_norm, row, 0, 1, q_size, float(eps_));
      k->rms_norm(row + q_size, L.k_norm, row + q_size, 0, 1, kv_size, float(eps_));
    }
  }
  const int64_t group = kv.layer_slots[2 * i], slot = kv.layer_slots[2 * i + 1];
  const uintptr_t kc = kv.k + uintptr_t(slot * kv.layer_bytes), vc = kv.v + uintptr_t(slot * kv.layer_bytes);
  const uintptr_t ks = kv.k_scale ? kv.k_scale + uintptr_t(slot * kv.scale_layer_bytes) : 0;
  const uintptr_t vs = kv.v_scale ? kv.v_scale + uintptr_t(slot * kv.scale_layer_bytes) : 0;
  rope_and_cache(addr(qkv), n, heads_, kv_heads_, head_dim_, addr(positions), addr(L.cos), addr(L.sin), kc, vc,
                 addr(kv.slot_mappings + group * n), qkv_rows, kv.dtype, ks, vs, per_head ? addr(L.q_norm) : 0,
                 per_head ? addr(L.k_norm) : 0, eps_);
  float* attn = floats(attn_, n * q_size);
  attention_decode(addr(qkv), kc, vc, addr(kv.token_tables + group * n * kv.max_blocks), addr(kv.context_lens),
                   addr(attn), n, heads_, kv_heads_, head_dim_, kv.block_size, attn_scale_, kv.max_blocks, qkv_rows,
                   kv.dtype, ks, vs, L.window, attn_softcap_, addr(L.sinks));
  float* o = floats(o_, n * d);
  L.o(attn, o, n, L.o_bias);
  add_rms_norm(addr(x), addr(o), addr(L.post_norm), addr(h), n, d, eps_, addr(L.attn_out_norm));
  float* down = floats(down_, n * d);
  if (L.experts) {
    L.experts->forward_routed(*L.router, addr(h), n, moe_k_, addr(down), moe_normalize_);
    return;
  }
  const int64_t ffn = L.down.cols();
  float* gate_up = floats(gate_up_, n * 2 * ffn);
  L.gate_up(h, gate_up, n, nullptr);
  float* act = floats(act_, n * ffn);
  if (gelu_tanh_)
    geglu(addr(gate_up), addr(act), n, ffn);
  else
    swiglu(addr(gate_up), addr(act), n, ffn);
  L.down(act, down, n, nullptr);
}

}  // namespace churon
