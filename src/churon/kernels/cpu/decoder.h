// DecoderStack: a decoder model's whole layer stack as one call, so that Python touches a step once
// instead of ~10 times a layer. It runs the same functions the per-op path calls from Python
// (QMatrix::matmul, add_rms_norm, rope_and_cache, attention_decode, swiglu/geglu,
// MoeExperts::forward_routed) in the same order on the same inputs, into buffers it keeps between
// steps, so its results are bitwise the per-op path's (model/transformer.py, Transformer.hidden_states
// and DecoderBlock, is the reading of this code in Python). Weights are borrowed: the Python objects
// that own them must outlive the stack (the binding keeps the matrices alive, NativeBackend the
// vectors).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "driver.h"
#include "qmatrix.h"

namespace churon {

// a weight matrix as a layer holds it: one QMatrix, or parts of several types run as one
struct Linear {
  QMatrix* matrix = nullptr;
  const QMatrixStack* stack = nullptr;
  int64_t rows() const { return matrix ? matrix->rows() : stack ? stack->rows() : 0; }
  int64_t cols() const { return matrix ? matrix->cols() : stack ? stack->cols() : 0; }
  void operator()(const float* x, float* y, int64_t m, const float* bias) const;
};

// one layer's weights (null pointers: absent) and where its K/V live
struct DecoderLayer {
  Linear qkv, o, gate_up, down;  // gate_up and down empty on an MoE layer
  const float* input_norm = nullptr;
  const float* post_norm = nullptr;      // the norm before the MLP
  const float* attn_out_norm = nullptr;  // Gemma: the norms on the attention's and the MLP's outputs
  const float* mlp_out_norm = nullptr;
  const float* qkv_bias = nullptr;
  const float* o_bias = nullptr;
  const float* sinks = nullptr;          // [heads]
  const float* q_norm = nullptr;         // per head [head_dim] or over all of q [heads * head_dim] (head_norms)
  const float* k_norm = nullptr;
  const float* cos = nullptr;            // this layer's RoPE tables [positions, head_dim]
  const float* sin = nullptr;
  int64_t window = 0;
  const MoeExperts* experts = nullptr;   // an MoE layer: the softmax router's routed experts
  QMatrix* router = nullptr;
};

// The KV memory of one step as the stack sees it: per model layer its K/V base and block tables
struct KvView {
  uintptr_t k = 0, v = 0, k_scale = 0, v_scale = 0;  // [group size, slots, kv heads, head dim] and int8 scales
  int64_t layer_bytes = 0, scale_layer_bytes = 0;     // from one index of k (of k_scale) to the next
  std::string dtype;                                  // as rope_and_cache takes it
  int64_t block_size = 0;
  const int64_t* layer_slots = nullptr;  // [layers, 2]: the layer's KV group and its index in k / v
  const int64_t* slot_mappings = nullptr;  // [groups, tokens]
  const int32_t* token_tables = nullptr;   // [groups, tokens, max_blocks]
  int64_t max_blocks = 0;
  const int32_t* context_lens = nullptr;   // [tokens]: keys each token sees
};

class DecoderStack {
 public:
  // embed: the token embeddings [vocab, hidden]; final_norm [hidden]; embed_scale 0: the embeddings as they
  // are, else multiplied by it (Gemma); gelu_tanh: GeGLU MLPs, else SwiGLU; head_norms: q_norm / k_norm are
  // per head (Qwen3, Gemma 3), else over all of q and all of k (OLMoE); moe_k / moe_normalize: the MoE layers'
  // experts per token and whether their weights are renormalized
  DecoderStack(QMatrix& embed, const float* final_norm, int64_t heads, int64_t kv_heads, int64_t head_dim,
               double eps, double attn_scale, double attn_softcap, double embed_scale, bool gelu_tanh,
               bool head_norms, int64_t moe_k, bool moe_normalize);

  void add_layer(const DecoderLayer& layer);
  int64_t num_layers() const { return int64_t(layers_.size()); }

  // Every layer over the step's tokens (ids and positions int64 [tokens]); out [rows, hidden] = the final
  // hidden states (after the last norm) of the tokens rows (int64 [n_rows]) names.
  void forward(const int64_t* ids, const int64_t* positions, int64_t tokens, const KvView& kv, const int64_t* rows,
               int64_t n_rows, float* out);

 private:
  // the layer's attention and MLP: x += attention output (Gemma: normed), h = x's post-attention norm; leaves
  // the MLP's output in down_
  void layer_step(int64_t i, const int64_t* positions, int64_t n, const KvView& kv);

  QMatrix* embed_;
  const float* final_norm_;
  int64_t hidden_, heads_, kv_heads_, head_dim_;
  double eps_, attn_scale_, attn_softcap_, embed_scale_;
  bool gelu_tanh_, head_norms_;
  int64_t moe_k_;
  bool moe_normalize_;
  std::vector<DecoderLayer> layers_;
  // the step's activations, grown as needed: residual, normed, qkv, attention, o, gate_up, activation, MLP out
  Buffer x_, h_, qkv_, attn_, o_, gate_up_, act_, down_, last_;
};

}  // namespace churon
