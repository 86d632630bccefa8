// MoeExperts (see qmatrix.h): an MoE layer's routed experts in one call, on QMatrix's matmul
// kernels and the swiglu kernel of the current ISA.
//
// The step's (token, rank) pairs are sorted by expert (token order within an expert) and every
// phase works on rows in that order: expert e owns rows [start[e], start[e + 1]). Each kernel
// computes a row the same way whatever rows it is batched with and whoever runs it, so a
// token's result is what one QMatrix::matmul per expert gives.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "driver.h"
#include "isa.h"
#include "qmatrix.h"
#include "threadpool.h"

namespace churon {
namespace {

// scratch (calls are serialized by the GIL): the tokens' quantized rows, the same rows once per
// pair in expert order (float rows for float experts), gate_up's outputs, the SwiGLU rows and
// their quantization, down's outputs
Buffer g_tok_act, g_pair_act, g_pair_x, g_gate_up, g_mid, g_mid_act, g_down;
std::vector<int64_t> g_start, g_cursor, g_pos, g_src, g_used;
// forward_routed's router logits (softmaxed in place), and the experts and weights it chose
std::vector<float> g_logits, g_route_w;
std::vector<int64_t> g_route_ids;
std::vector<uint8_t> g_taken;

std::string shape(const QMatrix& w) { return std::to_string(w.rows()) + " x " + std::to_string(w.cols()); }

// one projection of every used expert in one parallel_for: work item i is row group i % ng of
// used expert i / ng (all experts' matrices have the same shape, so the same ngroups), over the
// expert's rows of x (quantized: xa; float weights: xf) into its rows of y
void experts_gemm(const KernelTable* k, const std::vector<const QMatrix*>& mats, const ActQ& xa, const float* xf,
                  int64_t x_cols, float* y) {
  const std::vector<int64_t>& used = g_used;
  const std::vector<int64_t>& start = g_start;
  const int64_t ng = mats[0]->weights().ngroups, rows = mats[0]->rows();
  parallel_for(int64_t(used.size()) * ng, kMatmulGrain, [&](int64_t b, int64_t e, int) {
    while (b < e) {  // a claim may span the end of one expert's groups and the start of the next's
      const int64_t g0 = b % ng, g1 = std::min(ng, g0 + (e - b));
      const int64_t ex = used[b / ng], r0 = start[ex], m = start[ex + 1] - r0;
      const QMatrix& w = *mats[ex];
      k->gemm(w.weights(), w.quantized() ? act_rows(xa, r0, m) : ActQ(), xf ? xf + r0 * x_cols : nullptr, m,
              y + r0 * rows, nullptr, g0, g1);
      b += g1 - g0;
    }
  });
}

bool any_quantized(const std::vector<const QMatrix*>& mats, bool want) {
  for (int64_t e : g_used)
    if (mats[e]->quantized() == want) return true;
  return false;
}

float* floats(Buffer& buf, int64_t n) {
  buf.reserve(size_t(n) * 4 + 64);
  return reinterpret_cast<float*>(buf.p);
}

}  // namespace

MoeExperts::MoeExperts(const std::vector<const QMatrix*>& gate_up, const std::vector<const QMatrix*>& down)
    : gate_up_(gate_up), down_(down) {
  if (gate_up.empty() || gate_up.size() != down.size())
    throw std::invalid_argument("MoeExperts: needs as many down matrices as gate_up ones (at least one), got " +
                                std::to_string(gate_up.size()) + " and " + std::to_string(down.size()));
  for (size_t e = 0; e < gate_up.size(); ++e)
    if (!gate_up[e] || !down[e]) throw std::invalid_argument("MoeExperts: expert " + std::to_string(e) + " is None");
  hidden_ = gate_up[0]->cols();
  ffn_ = gate_up[0]->rows() / 2;
  if (gate_up[0]->rows() % 2)
    throw std::invalid_argument("MoeExperts: gate_up must stack gate and up (an even number of rows), got " +
                                shape(*gate_up[0]));
  for (size_t e = 0; e < gate_up.size(); ++e) {
    if (gate_up[e]->rows() != 2 * ffn_ || gate_up[e]->cols() != hidden_ || down[e]->rows() != hidden_ ||
        down[e]->cols() != ffn_)
      throw std::invalid_argument("MoeExperts: expert " + std::to_string(e) + " has gate_up " + shape(*gate_up[e]) +
                                  " and down " + shape(*down[e]) + "; expert 0's shapes need gate_up " +
                                  std::to_string(2 * ffn_) + " x " + std::to_string(hidden_) + " and down " +
                                  std::to_string(hidden_) + " x " + std::to_string(ffn_));
  }
}

void MoeExperts::forward(uintptr_t hp, int64_t tokens, uintptr_t idsp, uintptr_t weightsp, int64_t k,
                         uintptr_t outp, bool normalize) const {
  if (tokens < 0) throw std::invalid_argument("moe_experts: tokens must be >= 0, got " + std::to_string(tokens));
  if (k < 1) throw std::invalid_argument("moe_experts: k must be >= 1, got " + std::to_string(k));
  if (tokens == 0) return;
  const float* h = ptr<const float>(hp, "moe_experts: h");
  const int64_t* ids = ptr<const int64_t>(idsp, "moe_experts: ids");
  const float* wts = ptr<const float>(weightsp, "moe_experts: weights");
  float* out = ptr<float>(outp, "moe_experts: out");
  const int64_t n_exp = num_experts(), pairs = tokens * k, hidden = hidden_, ffn = ffn_;
  for (int64_t p = 0; p < pairs; ++p)
    if (ids[p] < 0 || ids[p] >= n_exp)
      throw std::out_of_range("moe_experts: token " + std::to_string(p / k) + " (rank " + std::to_string(p % k) +
                              ") chose expert " + std::to_string(ids[p]) + ", outside [0, " + std::to_string(n_exp) +
                              ")");

  // the pairs sorted by expert (a counting sort: token order within an expert); pos[p]: pair p's row
  g_start.assign(size_t(n_exp) + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++g_start[size_t(ids[p]) + 1];
  for (int64_t e = 0; e < n_exp; ++e) g_start[e + 1] += g_start[e];
  g_cursor.assign(g_start.begin(), g_start.end() - 1);
  g_pos.resize(size_t(pairs));
  g_src.resize(size_t(pairs));
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t row = g_cursor[ids[p]]++;
    g_pos[p] = row;
    g_src[row] = p / k;
  }
  g_used.clear();
  for (int64_t e = 0; e < n_exp; ++e)
    if (g_start[e + 1] > g_start[e]) g_used.push_back(e);
  const int64_t* pos = g_pos.data();
  const int64_t* src = g_src.data();
  const KernelTable* kt_ = kt();

  // gate_up's input rows: each token's row quantized once, then copied to each of its pairs' rows
  ActQ pair_act;
  if (any_quantized(gate_up_, true)) {
    const ActQ tok = act_in(g_tok_act, tokens, hidden);
    quantize_rows(kt_, h, tokens, tok);
    pair_act = act_in(g_pair_act, pairs, hidden);
    rows_op(pairs, hidden, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) copy_act_row(tok, src[r], pair_act, r);
    });
  }
  float* pair_x = nullptr;
  if (any_quantized(gate_up_, false)) {
    pair_x = floats(g_pair_x, pairs * hidden);
    rows_op(pairs, hidden, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) std::memcpy(pair_x + r * hidden, h + src[r] * hidden, size_t(hidden) * 4);
    });
  }
  float* gate_up = floats(g_gate_up, pairs * 2 * ffn);
  experts_gemm(kt_, gate_up_, pair_act, pair_x, hidden, gate_up);

  // SwiGLU, and its rows quantized for down (each pair's row is its own: quantized once)
  float* mid = floats(g_mid, pairs * ffn);
  const bool mid_q = any_quantized(down_, true);
  const ActQ mid_act = mid_q ? act_in(g_mid_act, pairs, ffn) : ActQ();
  rows_op(pairs, ffn, [&](int64_t b, int64_t e) {
    kt_->swiglu(gate_up, mid, b, e, ffn);
    if (mid_q) kt_->quantize_act(mid, b, e, mid_act);
  });
  float* y = floats(g_down, pairs * hidden);
  experts_gemm(kt_, down_, mid_act, mid, ffn, y);

  // each token's weighted terms summed in rank order, every product rounded before its sum; normalize:
  // the weights first divided by their own sum, added in rank order too
  rows_op(tokens, k * hidden, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* wt = wts + t * k;
      float sum = 1.0f;
      if (normalize) {
        sum = wt[0];
        for (int64_t r = 1; r < k; ++r) sum = sum + wt[r];
      }
      float* o = out + t * hidden;
      const float* y0 = y + pos[t * k] * hidden;
      const float w0 = normalize ? wt[0] / sum : wt[0];
      for (int64_t c = 0; c < hidden; ++c) o[c] = y0[c] * w0;
      for (int64_t r = 1; r < k; ++r) {
        const float* yr = y + pos[t * k + r] * hidden;
        const float wr = normalize ? wt[r] / sum : wt[r];
        for (int64_t c = 0; c < hidden; ++c) o[c] = o[c] + yr[c] * wr;
      }
    }
  });
}

void MoeExperts::forward_routed(QMatrix& router, uintptr_t hp, int64_t tokens, int64_t k, uintptr_t outp,
                                bool normalize) const {
  const int64_t n_exp = num_experts();
  if (router.rows() != n_exp || router.cols() != hidden_)
    throw std::invalid_argument("routed_experts: the router must be " + std::to_string(n_exp) + " x " +
                                std::to_string(hidden_) + " (experts x hidden), got " + shape(router));
  if (k < 1 || k > n_exp)
    throw std::invalid_argument("routed_experts: k must be in [1, " + std::to_string(n_exp) + "], got " +
                                std::to_string(k));
  if (tokens < 0) throw std::invalid_argument("routed_experts: tokens must be >= 0, got " + std::to_string(tokens));
  if (tokens == 0) return;
  g_logits.resize(size_t(tokens * n_exp));
  router.matmul(hp, reinterpret_cast<uintptr_t>(g_logits.data()), tokens, 0, false);
  g_route_ids.resize(size_t(tokens * k));
  g_route_w.resize(size_t(tokens * k));
  for (int64_t t = 0; t < tokens; ++t) {  // a handful of experts a token: not worth the threads
    float* p = g_logits.data() + t * n_exp;
    float mx = p[0];
    for (int64_t e = 1; e < n_exp; ++e) mx = std::max(mx, p[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < n_exp; ++e) {
      p[e] = std::exp(p[e] - mx);
      sum = sum + p[e];
    }
    for (int64_t e = 0; e < n_exp; ++e) p[e] = p[e] / sum;
    // selection: k passes over the experts not yet taken; a NaN row (the request's own failure, which its
    // logits will show) takes its first k experts, with NaN weights
    g_taken.assign(size_t(n_exp), 0);
    for (int64_t r = 0; r < k; ++r) {
      int64_t best = -1;
      for (int64_t e = 0; e < n_exp; ++e)
        if (!g_taken[e] && (best < 0 || p[e] > p[best])) best = e;
      g_taken[best] = 1;
      g_route_ids[t * k + r] = best;
      g_route_w[t * k + r] = p[best];
    }
  }
  forward(hp, tokens, reinterpret_cast<uintptr_t>(g_route_ids.data()), reinterpret_cast<uintptr_t>(g_route_w.data()),
          k, outp, normalize);
}

}  // namespace churon
