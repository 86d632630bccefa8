// QMatrix: one weight matrix in the layout the kernels read (see common.h), and the parallel
// drivers of its matmul and dequantization; QMatrixStack: matrices of several types stacked by rows,
// run as one; MoeExperts: an MoE layer's routed experts, run in one call (moe.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "driver.h"
#include "weight_memory.h"

namespace churon {

class QMatrix {
 public:
  // raw: the GGUF bytes of a [rows, cols] matrix of GGML type qtype, raw_bytes of them;
  // raw_contiguous: whether the buffer they came in is (else std::invalid_argument)
  QMatrix(const uint8_t* raw, int64_t raw_bytes, bool raw_contiguous, int qtype, int64_t rows, int64_t cols);

  int64_t rows() const { return w_.rows; }
  int64_t cols() const { return w_.cols; }
  int qtype() const { return w_.qtype; }
  const std::string& layout() const { return layout_; }
  int64_t nbytes() const { return nbytes_; }

  bool quantized() const { return !(w_.qtype == kF32 || w_.qtype == kF16 || w_.qtype == kBF16); }
  const QWeights& weights() const { return w_; }

  void matmul(uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t biasp, bool precise);
  // y[m, rows]: the precise product where a value may be its row's maximum, the hi part alone (8-bit activations)
  // where it is sure to be below the maximum, so each row's first maximum is the precise product's (greedy
  // decoding's token) for a fraction of the lo part's cost: the lo products run only for the 16-row groups that
  // may hold it. A row with NaN or inf gets every lo product. Q8_0 weights from 2 rows; one row reads the coarse
  // copy prepare_argmax built (a quarter fewer bytes), then the precise product of the groups that may hold the
  // maximum; otherwise matmul(precise).
  void matmul_argmax(uintptr_t xp, uintptr_t yp, int64_t m);
  // Builds the coarse copy matmul_argmax's one-row case reads (Q8_0 where the ISA has its kernel: 6 of each code's
  // 8 bits, common.h's kCoarseUnitBytes; nbytes grows by it); false, and nothing built, elsewhere
  bool prepare_argmax();
  void dequantize(uintptr_t outp);
  void dequantize_bf16(uintptr_t outp);
  // out[i, :] = dequantized row ids[i] (an embedding lookup); ids int64
  void dequantize_rows(uintptr_t idsp, int64_t n, uintptr_t outp);

 private:
  ActQ quantize_split(const KernelTable* k, const float* x, int64_t m);
  void argmax_one_row(const KernelTable* k, const float* x, float* y);
  // per weight row, its Euclidean norm, rounded up (Q8_0; built on first use)
  const std::vector<float>& row_norms();

  QWeights w_;
  WeightMemory mem_;
  std::string layout_;
  int64_t nbytes_ = 0;
  std::vector<float> row_norms_;
  WeightMemory coarse_;               // prepare_argmax's copy
  std::vector<float> coarse_bounds_;  // per row: its coarse product's distance from the precise one, per unit of |hi|
};

// Matrices of different types stacked by rows, [sum of their rows, cols] (llama.cpp's Q4_K_M puts a
// Q6_K v beside Q4_K q and k in half the layers: no one layout holds all three). One matmul runs them
// all: x quantized once, every part's row groups in one parallel_for, each part's outputs in its own
// columns of y; a row's bits are each part's own matmul's. The parts are borrowed: they must outlive
// this object (the Python binding keeps them alive).
class QMatrixStack {
 public:
  explicit QMatrixStack(const std::vector<const QMatrix*>& parts);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return parts_[0]->cols(); }
  int64_t nbytes() const;
  std::string layout() const;

  void matmul(uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t biasp) const;

 private:
  std::vector<const QMatrix*> parts_;
  std::vector<QWeights> weights_;  // the parts' weights, writing rows of y of the stack's width
  std::vector<int64_t> row0_, group0_;  // each part's first row and first row group in the stack (+ the ends)
  int64_t rows_ = 0;
};

// The routed experts of one MoE layer: expert e's gate and up projections stacked by rows
// (gate_up[e], [2 ffn, hidden]) and its down projection (down[e], [hidden, ffn]). The matrices are
// borrowed: they must outlive this object (the Python binding keeps them alive).
//
// forward: for each token t, out[t] = sum over r < k, in rank order, of
// w[t, r] * down_e(swiglu(gate_up_e(h[t]))), e = ids[t, r]; each product rounded, then the
// sum ((p0 + p1) + p2) + ... : bitwise what QMatrix::matmul, swiglu and float32 products and sums
// give one expert at a time, whatever the batch, the thread count or who else shares an expert.
// w = weights, or with normalize weights[t, r] / (((weights[t, 0] + weights[t, 1]) + ...)
// (the families that renormalize their top k: torch's float32 division by the rank-ordered sum).
// The (token, rank) pairs are grouped by expert; a token's activation row is quantized once for
// all of its experts; each phase (gate_up, swiglu, down) runs all the experts' work in one
// parallel_for.
class MoeExperts {
 public:
  MoeExperts(const std::vector<const QMatrix*>& gate_up, const std::vector<const QMatrix*>& down);

  int64_t num_experts() const { return int64_t(gate_up_.size()); }
  int64_t hidden() const { return hidden_; }
  int64_t ffn() const { return ffn_; }

  // h float32 [tokens, hidden], ids int64 [tokens, k], weights float32 [tokens, k],
  // out float32 [tokens, hidden]; all C-contiguous
  void forward(uintptr_t hp, int64_t tokens, uintptr_t idsp, uintptr_t weightsp, int64_t k, uintptr_t outp,
               bool normalize) const;
  // forward with the routing of the softmax-router families (all but gpt-oss) in the same call: the router's
  // logits of h ([experts, hidden]), their float32 softmax (max subtracted, the exps summed in expert order),
  // each token's k most probable experts, best first (a tie: the lower id first), their probabilities as
  // the weights. Row by row, so a token's experts and result do not depend on the batch.
  void forward_routed(QMatrix& router, uintptr_t hp, int64_t tokens, int64_t k, uintptr_t outp, bool normalize) const;

 private:
  std::vector<const QMatrix*> gate_up_, down_;
  int64_t hidden_ = 0, ffn_ = 0;
};

}  // namespace churon
