// QMatrix and QMatrixStack (see qmatrix.h): construction, and the parallel drivers of their matmuls
// and of dequantization around the kernels of the current ISA.

#include "qmatrix.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "isa.h"
#include "repack.h"
#include "threadpool.h"

namespace churon {
namespace {

// scratch for quantized activations and the precise path, and matmul_argmax's bounds: per row and parallel_for
// chunk, per row and weight group (calls are serialized by the GIL)
Buffer g_act_buf, g_precise_buf;
std::vector<float> g_chunk_top;
std::vector<uint8_t> g_chunk_bad;
std::vector<float> g_group_high;

// the Euclidean norm of activation row i as the kernels multiply it: its codes times their block scales
double act_norm(const ActQ& a, int64_t i) {
  double sum = 0;
  for (int64_t b = 0; b < a.nb; ++b) {
    double squares = 0;
    for (int64_t c = 0; c < kActBlock; ++c) {
      const double v = a.q[i * a.cols + b * kActBlock + c];
      squares += v * v;
    }
    sum += double(a.d[i * a.nb + b]) * a.d[i * a.nb + b] * squares;
  }
  return std::sqrt(sum);
}

// whether a matmul of m rows has work (m < 0 raises)
bool matmul_rows(int64_t m) {
  if (m < 0) throw std::invalid_argument("matmul: m must be >= 0");
  return m > 0;
}

}  // namespace

QMatrix::QMatrix(const uint8_t* raw, int64_t raw_bytes, bool raw_contiguous, int qtype, int64_t rows,
                 int64_t cols) {
  const char* name = qtype_name(qtype);
  if (!name) {
    throw std::invalid_argument("QMatrix: GGML type id " + std::to_string(qtype) +
                                " is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)");
  }
  if (rows <= 0 || cols <= 0)
    throw std::invalid_argument("QMatrix: rows and cols must be positive, got " + std::to_string(rows) + " x " +
                                std::to_string(cols));
  int64_t bs, ts;
  gguf_block(qtype, bs, ts);
  if (cols % bs != 0) {
    throw std::invalid_argument(std::string("QMatrix: ") + name + " needs cols to be a multiple of " +
                                std::to_string(bs) + ", got " + std::to_string(cols));
  }
  const int64_t want = rows * (cols / bs) * ts;
  if (raw_bytes != want) {
    throw std::invalid_argument(std::string("QMatrix: a ") + name + " matrix of " + std::to_string(rows) + " x " +
                                std::to_string(cols) + " needs " + std::to_string(want) + " bytes, got " +
                                std::to_string(raw_bytes));
  }
  if (!raw_contiguous) throw std::invalid_argument("QMatrix: raw bytes must be contiguous");

  w_.qtype = qtype;
  w_.rows = rows;
  w_.cols = cols;
  w_.ngroups = (rows + kGroupRows - 1) / kGroupRows;
  w_.ldy = rows;
  if (qtype == kF32 || qtype == kF16 || qtype == kBF16) {
    w_.unit_cols = cols;
    w_.nunits = 1;
    w_.unit_bytes = cols * ts;  // one row
    w_.group_bytes = w_.unit_bytes * kGroupRows;
    mem_ = WeightMemory(size_t(want) + 64);
    std::memcpy(mem_.data(), raw, size_t(want));
    layout_ = std::string(name) + " row-major (GGUF rows unchanged)";
    nbytes_ = want;
  } else {
    w_.unit_cols = unit_cols_of(w_.qtype);
    w_.nunits = cols / w_.unit_cols;
    w_.unit_bytes = unit_bytes_of(w_.qtype);
    w_.group_bytes = w_.nunits * w_.unit_bytes;
    nbytes_ = w_.ngroups * w_.group_bytes;
    mem_ = WeightMemory(size_t(nbytes_) + 64);
    repack_x16(w_, raw, mem_.data());
    layout_ = std::string(name) + " repacked x16 rows (" + std::to_string(w_.unit_cols) + "-column units of " +
              std::to_string(w_.unit_bytes) + " bytes)";
  }
  w_.data = mem_.data();
}

// The precise path's activations: rows 0..m-1 of the result the 8-bit codes of x (hi), rows m..2m-1 those of
// lo = x - hi, quantized in turn at its own (~127x finer) scale; lo itself stays in g_precise_buf.
ActQ QMatrix::quantize_split(const KernelTable* k, const float* x, int64_t m) {
  const int64_t cols = w_.cols;
  ActQ a = act_in(g_act_buf, 2 * m, cols);
  quantize_rows(k, x, m, a);
  g_precise_buf.reserve(size_t(m * cols + 2 * m * w_.rows) * 4 + 64);
  float* lo = reinterpret_cast<float*>(g_precise_buf.p);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < cols; ++c)
      lo[i * cols + c] = x[i * cols + c] - float(a.q[i * cols + c]) * a.d[i * a.nb + c / kActBlock];
  quantize_rows(k, lo, m, act_rows(a, m, m));
  return a;
}

void QMatrix::matmul(uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t biasp, bool precise) {
  if (!matmul_rows(m)) return;
  const float* x = ptr<const float>(xp, "matmul: x");
  float* y = ptr<float>(yp, "matmul: y");
  const float* bias = reinterpret_cast<const float*>(biasp);  // may be null
  const KernelTable* k = kt();
  const QWeights& w = w_;
  const int64_t ng = w_.ngroups;
  if (!quantized()) {
    parallel_for(ng, kMatmulGrain, [&](int64_t b, int64_t e, int) { k->gemm(w, ActQ(), x, m, y, bias, b, e); });
    return;
  }
  if (!precise) {
    const ActQ a = act_in(g_act_buf, m, w_.cols);
    quantize_rows(k, x, m, a);
    parallel_for(ng, kMatmulGrain, [&](int64_t b, int64_t e, int) { k->gemm(w, a, x, m, y, bias, b, e); });
    return;
  }
  // x = hi + lo: one matmul over both (the weights are read once), then summed
  const ActQ a = quantize_split(k, x, m);
  float* y2 = reinterpret_cast<float*>(g_precise_buf.p) + m * w_.cols;
  const int64_t rows = w_.rows, n = m * rows;
  parallel_for(ng, kMatmulGrain, [&](int64_t g0, int64_t g1, int) {
    k->gemm(w, a, nullptr, 2 * m, y2, nullptr, g0, g1);
    const int64_t r0 = g0 * kGroupRows, r1 = std::min(g1 * kGroupRows, rows);
    for (int64_t i = 0; i < m; ++i)  // hi + lo of these rows while they are in cache
      for (int64_t r = r0; r < r1; ++r) {
        const float v = y2[i * rows + r] + y2[n + i * rows + r];
        y[i * rows + r] = bias ? v + bias[r] : v;
      }
  });
}

const std::vector<float>& QMatrix::row_norms() {
  if (!row_norms_.empty()) return row_norms_;
  // Q8_0 in x16 units: 512 bytes of codes (+128; byte 64 j + 4 n + t: row n, column 4 j + t), then the 16 rows'
  // float16 scales; a group's rows on one thread (the first batched greedy step, or prepare_argmax, waits for it)
  std::vector<float> norms(static_cast<size_t>(w_.ngroups * kGroupRows), 0.0f);
  parallel_for(w_.ngroups, 16, [&](int64_t g0, int64_t g1, int) {
    for (int64_t g = g0; g < g1; ++g) {
      double sum[kGroupRows] = {};
      for (int64_t u = 0; u < w_.nunits; ++u) {
        const uint8_t* p = w_.data + g * w_.group_bytes + u * w_.unit_bytes;
        int64_t squares[kGroupRows] = {};
        for (int j = 0; j < 8; ++j)
          for (int n = 0; n < kGroupRows; ++n)
            for (int t = 0; t < 4; ++t) {
              const int v = int(p[64 * j + 4 * n + t]) - 128;
              squares[n] += v * v;
            }
        for (int n = 0; n < kGroupRows; ++n) {
          uint16_t h;
          std::memcpy(&h, p + 512 + 2 * n, 2);
          const double d = fp16_to_fp32(h);
          sum[n] += d * d * double(squares[n]);
        }
      }
      for (int n = 0; n < kGroupRows; ++n) norms[g * kGroupRows + n] = float(std::sqrt(sum[n]) * (1 + 0x1p-20));
    }
  });
  row_norms_ = std::move(norms);
  return row_norms_;
}

bool QMatrix::prepare_argmax() {
  if (!coarse_bounds_.empty()) return true;
  if (w_.qtype != kQ8_0 || !kt()->gemm_coarse) return false;
  const int64_t nu = w_.nunits, ng = w_.ngroups;
  WeightMemory mem(size_t(ng * nu * kCoarseUnitBytes) + 64);
  std::vector<double> res(size_t(ng * kGroupRows));  // per row, the residuals' sum of squares
  parallel_for(ng, 16, [&](int64_t g0, int64_t g1, int) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t u = 0; u < nu; ++u) {
        // Q8_0 x16 unit: byte 64 j + 4 n + t is row n, column 4 j + t, stored + 128; then 16 float16 scales
        const uint8_t* src = w_.data + g * w_.group_bytes + u * w_.unit_bytes;
        uint8_t* dst = mem.data() + (g * nu + u) * kCoarseUnitBytes;
        std::memset(dst, 0, kCoarseScales);
        std::memcpy(dst + kCoarseScales, src + 512, 2 * kGroupRows);
        int64_t rr[kGroupRows] = {};
        for (int i = 0; i < 512; ++i) {  // i = 64 j + 4 n + t: column 4 j + t, coarse half j / 4, its j % 4
          const int q = int(src[i]) - 128;
          const int c = std::min((q + 2) >> 2, 31) + 32;
          const int r = q - 4 * (c - 32);
          rr[(i & 63) >> 2] += r * r;
          dst[i & 255] |= uint8_t((c & 15) << (4 * (i >> 8)));
          dst[kQ6Hb + 64 * (i >> 8) + (i & 63)] |= uint8_t((c >> 4) << (2 * ((i >> 6) & 3)));
        }
        for (int n = 0; n < kGroupRows; ++n) {
          uint16_t h;
          std::memcpy(&h, src + 512 + 2 * n, 2);
          const double d = fp16_to_fp32(h);
          res[g * kGroupRows + n] += d * d * double(rr[n]);
        }
      }
  });
  // Row r's precise product of an activation row x^ = hi + lo (the kernels' operands) and the coarse product of hi
  // differ by hi . res_r + lo . w_r exactly: at most |hi| R + |lo| W (Cauchy-Schwarz; R = |res_r|, W = |w_r|), plus
  // the float sums over nu blocks, under (nu + 2) 2^-24 of |hi| W (precise), |hi| (W + R) (coarse) and |lo| W, and
  // the hi + lo addition, 2^-24 of |hi| (W + R) + |lo| W. Per unit of |hi|: this bound (the |lo| terms, per unit of
  // |lo|, are row_norms(), widened by argmax_one_row), widened for its own rounding.
  const float* whole = row_norms().data();
  std::vector<float> bounds(size_t(ng * kGroupRows), 0.0f);
  for (int64_t r = 0; r < w_.rows; ++r) {
    const double R = std::sqrt(res[r]), W = whole[r];
    bounds[r] = float((R * (1 + 0x1p-20) + double(nu + 16) * 0x1p-22 * (W + R)) * (1 + 0x1p-20));
  }
  coarse_ = std::move(mem);
  coarse_bounds_ = std::move(bounds);
  nbytes_ += ng * nu * kCoarseUnitBytes;
  layout_ += " + a 6-bit coarse copy for one-row argmax";
  return true;
}

void QMatrix::argmax_one_row(const KernelTable* k, const float* x, float* y) {
  const int64_t ng = w_.ngroups, rows = w_.rows, nb = w_.cols / kActBlock;
  const ActQ a = quantize_split(k, x, 1);  // row 0 hi, row 1 lo
  const float c = float(act_norm(a, 0) * (1 + 0x1p-20)), c2 = float(act_norm(a, 1) * (1 + double(nb + 8) * 0x1p-22));
  const float* whole = row_norms().data();
  QWeights cw = w_;
  cw.data = coarse_.data();
  float* y2 = reinterpret_cast<float*>(g_precise_buf.p) + w_.cols;  // [2][rows]: the precise products' hi and lo
  g_chunk_top.assign(static_cast<size_t>(ng), -INFINITY);
  g_chunk_bad.assign(static_cast<size_t>(ng), 0);
  g_group_high.resize(static_cast<size_t>(ng));
  parallel_for(ng, kMatmulGrain, [&](int64_t g0, int64_t g1, int) {
    k->gemm_coarse(cw, a, y, g0, g1);  // hi's coarse product
    const int64_t r0 = g0 * kGroupRows, r1 = std::min(g1 * kGroupRows, rows);
    bool bad = false;
    g_chunk_top[g0] = k->argmax_bounds(y + r0, coarse_bounds_.data() + r0, c, whole + r0, c2, r1 - r0,
                                       g_group_high.data() + g0, &bad);
    g_chunk_bad[g0] = bad;
  });
  const float top = *std::max_element(g_chunk_top.begin(), g_chunk_top.end());
  const bool all = std::any_of(g_chunk_bad.begin(), g_chunk_bad.end(), [](uint8_t v) { return v; }) ||
                   !std::isfinite(c) || !std::isfinite(c2) || !(top > -INFINITY);
  if (all) {  // NaN or inf in x or a product: no bound, the precise product
    matmul(reinterpret_cast<uintptr_t>(x), reinterpret_cast<uintptr_t>(y), 1, 0, true);
    return;
  }
  // the groups that may hold the maximum (hundreds of Gemma 3's 16,384 for a flat distribution): the precise product's
  // kernel on the same codes, its hi + lo, on every thread
  std::vector<int64_t> maybe;
  for (int64_t g = 0; g < ng; ++g)
    if (g_group_high[g] >= top) maybe.push_back(g);
  parallel_for(int64_t(maybe.size()), 4, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t g = maybe[i];
      k->gemm(w_, a, nullptr, 2, y2, nullptr, g, g + 1);
      for (int64_t r = g * kGroupRows; r < std::min((g + 1) * kGroupRows, rows); ++r) y[r] = y2[r] + y2[rows + r];
    }
  });
}

void QMatrix::matmul_argmax(uintptr_t xp, uintptr_t yp, int64_t m) {
  if (!matmul_rows(m)) return;
  const float* x = ptr<const float>(xp, "matmul_argmax: x");
  float* y = ptr<float>(yp, "matmul_argmax: y");
  const KernelTable* k = kt();
  // One row: its lo product costs little beside reading the weights (SmolLM2's logits: 0.65 ms either way, 2 threads,
  // AMX Xeon), but fewer bytes read do: the coarse copy. From 2 rows the lo part's cost counts (precise against this:
  // m = 9 2.0 / 1.5 ms, 32 4.3 / 3.1, 64 14.6 / 6.8).
  if (m == 1 && !coarse_bounds_.empty() && k->gemm_coarse) return argmax_one_row(k, x, y);
  if (w_.qtype != kQ8_0 || m < 2) return matmul(xp, yp, m, 0, true);
  const QWeights& w = w_;
  const int64_t ng = w_.ngroups, rows = w_.rows, nb = w_.cols / kActBlock;
  const float* norms = row_norms().data();
  const ActQ a = quantize_split(k, x, m);
  const ActQ lo = act_rows(a, m, m);
  float* lo_y = reinterpret_cast<float*>(g_precise_buf.p) + m * w_.cols;  // [m][rows]
  // Row i's lo product with weight row r is at most |lo_i| |w_r| (Cauchy-Schwarz, the norms of the values the kernel
  // multiplies), and the kernel's float sum over blocks errs by less than (nb + 2) ulps of the sum of the blocks'
  // magnitudes, itself within |lo_i| |w_r|: c[i] is |lo_i| widened for that and for these bounds' own rounding.
  std::vector<float> c(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) c[i] = float(act_norm(lo, i) * (1 + double(nb + 8) * 0x1p-22));
  // the hi products, straight into y; per row and per parallel_for chunk (at its first group) the most the chunk's
  // values are sure to reach and whether some hi value is not finite, and per group the most its values may reach
  g_chunk_top.assign(static_cast<size_t>(m * ng), -INFINITY);
  g_chunk_bad.assign(static_cast<size_t>(m * ng), 0);
  g_group_high.resize(static_cast<size_t>(m * ng));
  parallel_for(ng, kMatmulGrain, [&](int64_t g0, int64_t g1, int) {
    k->gemm(w, a, nullptr, m, y, nullptr, g0, g1);
    const int64_t r0 = g0 * kGroupRows, n = std::min(g1 * kGroupRows, rows) - r0;
    for (int64_t i = 0; i < m; ++i) {
      bool bad = false;
      g_chunk_top[i * ng + g0] =
          k->argmax_bounds(y + i * rows + r0, norms + r0, c[i], nullptr, 0, n, g_group_high.data() + i * ng + g0, &bad);
      g_chunk_bad[i * ng + g0] = bad;
    }
  });
  // a group with a value that may reach its row's maximum gets the lo products (the kernel's, as the precise matmul's)
  // added: hi + lo, the precise value; every other value stays hi, below the maximum
  for (int64_t i = 0; i < m; ++i) {
    const float top = *std::max_element(g_chunk_top.begin() + i * ng, g_chunk_top.begin() + (i + 1) * ng);
    const bool all = std::any_of(g_chunk_bad.begin() + i * ng, g_chunk_bad.begin() + (i + 1) * ng,
                                 [](uint8_t v) { return v; }) ||
                     !std::isfinite(c[i]) || !(top > -INFINITY);  // NaN or inf in x: no bound, every lo product
    const ActQ row = act_rows(lo, i, 1);
    float* out = y + i * rows;
    for (int64_t g = 0; g < ng; ++g) {
      if (!all && !(g_group_high[i * ng + g] >= top)) continue;
      k->gemm(w, row, nullptr, 1, lo_y + i * rows, nullptr, g, g + 1);
      for (int64_t r = g * kGroupRows; r < std::min((g + 1) * kGroupRows, rows); ++r) out[r] += lo_y[i * rows + r];
    }
  }
}

QMatrixStack::QMatrixStack(const std::vector<const QMatrix*>& parts) : parts_(parts) {
  if (parts.empty()) throw std::invalid_argument("QMatrixStack: needs at least one part");
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i]) throw std::invalid_argument("QMatrixStack: part " + std::to_string(i) + " is None");
    if (parts[i]->cols() != parts[0]->cols())
      throw std::invalid_argument("QMatrixStack: part " + std::to_string(i) + " has " +
                                  std::to_string(parts[i]->cols()) + " columns, part 0 " +
                                  std::to_string(parts[0]->cols()) + ": stacked rows need the same columns");
  }
  int64_t groups = 0;
  for (const QMatrix* p : parts) {
    row0_.push_back(rows_);
    group0_.push_back(groups);
    rows_ += p->rows();
    groups += p->weights().ngroups;
  }
  row0_.push_back(rows_);
  group0_.push_back(groups);
  for (const QMatrix* p : parts) {
    QWeights w = p->weights();
    w.ldy = rows_;
    weights_.push_back(w);
  }
}

int64_t QMatrixStack::nbytes() const {
  int64_t n = 0;
  for (const QMatrix* p : parts_) n += p->nbytes();
  return n;
}

std::string QMatrixStack::layout() const {
  std::string s;
  for (const QMatrix* p : parts_) s += (s.empty() ? "" : " + ") + p->layout();
  return s;
}

void QMatrixStack::matmul(uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t biasp) const {
  if (!matmul_rows(m)) return;
  const float* x = ptr<const float>(xp, "matmul: x");
  float* y = ptr<float>(yp, "matmul: y");
  const float* bias = reinterpret_cast<const float*>(biasp);  // may be null
  const KernelTable* k = kt();
  bool any_quantized = false;
  for (const QMatrix* p : parts_) any_quantized = any_quantized || p->quantized();
  ActQ a;
  if (any_quantized) {  // the same 8-bit rows whatever the type: quantized once for every part
    a = act_in(g_act_buf, m, cols());
    quantize_rows(k, x, m, a);
  }
  const int64_t n = int64_t(parts_.size());
  parallel_for(group0_[n], kMatmulGrain, [&](int64_t b, int64_t e, int) {
    int64_t i = 0;
    while (b < e) {  // a claim may span the end of one part's groups and the start of the next's
      while (group0_[i + 1] <= b) ++i;
      const int64_t g1 = std::min(e, group0_[i + 1]);
      k->gemm(weights_[i], parts_[i]->quantized() ? a : ActQ(), x, m, y + row0_[i], bias ? bias + row0_[i] : nullptr,
              b - group0_[i], g1 - group0_[i]);
      b = g1;
    }
  });
}

void QMatrix::dequantize(uintptr_t outp) {
  float* out = ptr<float>(outp, "dequantize: out");
  const KernelTable* k = kt();
  const QWeights& w = w_;
  parallel_for(w_.rows, chunk_for(w_.rows, 16), [&](int64_t b, int64_t e, int) { k->dequant(w, b, e, out + b * w.cols); });
}

void QMatrix::dequantize_bf16(uintptr_t outp) {
  uint16_t* out = ptr<uint16_t>(outp, "dequantize_bf16: out");
  const KernelTable* k = kt();
  const QWeights& w = w_;
  parallel_for(w_.rows, chunk_for(w_.rows, 16), [&](int64_t b, int64_t e, int) { k->dequant_bf16(w, b, e, out + b * w.cols); });
}

void QMatrix::dequantize_rows(uintptr_t idsp, int64_t n, uintptr_t outp) {
  if (n <= 0) return;
  const int64_t* ids = ptr<const int64_t>(idsp, "dequantize_rows: ids");
  float* out = ptr<float>(outp, "dequantize_rows: out");
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= w_.rows)
      throw std::out_of_range("dequantize_rows: row id " + std::to_string(ids[i]) + " is outside [0, " +
                              std::to_string(w_.rows) + ")");
  }
  const KernelTable* k = kt();
  for (int64_t i = 0; i < n; ++i) k->dequant(w_, ids[i], ids[i] + 1, out + i * w_.cols);
}

}  // namespace churon
