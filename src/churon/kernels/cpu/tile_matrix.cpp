// Bf16TileMatrix (see tile_matrix.h): packing at construction, and the drivers of the matmul (the bias spread per
// group, the rows or the row groups split across threads) and of the GELU MLP (blocks of rows across threads).

#include "tile_matrix.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "driver.h"
#include "threadpool.h"

namespace churon {
namespace {

// scratch for the spread biases and the threads' converted rows (calls are serialized by the GIL)
Buffer g_bias_buf, g_rows_buf;

// the kernels' bias: a [ngroups * 16] row, zeros past the matrix's rows (and everywhere without a bias)
void spread_bias(const Bf16Tiles& t, const float* bias, float* out) {
  std::memset(out, 0, size_t(t.ngroups * 16) * 4);
  if (bias) std::memcpy(out, bias, size_t(t.rows) * 4);
}

}  // namespace

Bf16TileMatrix::Bf16TileMatrix(const float* w, int64_t raw_bytes, bool raw_contiguous, int64_t rows, int64_t cols) {
  tiles_ = bf16_tiles();
  if (!tiles_)
    throw std::invalid_argument("Bf16TileMatrix: no AMX-BF16 tiles here (CPU, Linux, compiler, or the ISA chosen)");
  if (rows <= 0 || cols <= 0 || rows > (int64_t(1) << 31) || cols > (int64_t(1) << 31) ||
      rows * cols > (int64_t(1) << 40))
    throw std::invalid_argument("Bf16TileMatrix: rows and cols must be in 1 .. 2^31, rows * cols at most 2^40");
  if (!raw_contiguous) throw std::invalid_argument("Bf16TileMatrix: the weights must be C-contiguous");
  if (raw_bytes != rows * cols * 4)
    throw std::invalid_argument("Bf16TileMatrix: " + std::to_string(raw_bytes) + " bytes for a " + std::to_string(rows) +
                                " x " + std::to_string(cols) + " float32 matrix (" + std::to_string(rows * cols * 4) +
                                " expected)");
  t_.rows = rows;
  t_.cols = cols;
  t_.kp = (cols + 31) / 32 * 32;
  t_.ngroups = (rows + 15) / 16;
  t_.ldy = rows;
  mem_ = WeightMemory(size_t(nbytes()) + 64);
  uint16_t* out = reinterpret_cast<uint16_t*>(mem_.data());
  // group g, step s: 16 rows (k) of 16 output rows n x 2 columns 32 s + 2 k + t, at 512 (g * steps + s) +
  // 32 k + 2 n + t; the pads zero
  std::memset(out, 0, size_t(nbytes()));
  const int64_t steps = t_.kp / 32;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / 16, n = r % 16;
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t s = c / 32, k = (c % 32) / 2, t = c % 2;
      out[512 * (g * steps + s) + 32 * k + 2 * n + t] = fp32_to_bf16(w[r * cols + c]);
    }
  }
  t_.data = out;
}

std::string Bf16TileMatrix::layout() const {
  return "BF16 AMX tiles (16-row groups, 32-column steps of 16 x 64 bytes, " + std::to_string(t_.kp) + " columns)";
}

void Bf16TileMatrix::matmul(uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t biasp) const {
  if (m < 0) throw std::invalid_argument("matmul: m must be >= 0");
  if (m == 0) return;
  const float* x = ptr<const float>(xp, "matmul: x");
  float* y = ptr<float>(yp, "matmul: y");
  const float* bias = reinterpret_cast<const float*>(biasp);  // may be null
  g_bias_buf.reserve(size_t(t_.ngroups * 16) * 4);
  float* bias16 = reinterpret_cast<float*>(g_bias_buf.p);
  spread_bias(t_, bias, bias16);
  const int64_t per_thread = 32 * t_.kp;  // bfloat16 of a thread's 32 converted rows
  g_rows_buf.reserve(size_t(per_thread * get_num_threads()) * 2);
  uint16_t* rows = reinterpret_cast<uint16_t*>(g_rows_buf.p);
  const Bf16Tiles& t = t_;
  const auto gemm = tiles_->gemm_bf16_tiles;
  const int64_t blocks = (m + 31) / 32;  // the kernel takes 32 rows at a time
  if (blocks >= 2 * get_num_threads()) {
    // Many rows: each thread takes blocks of rows and multiplies them by every group, so its rows stay in
    // its own cache beside the weights (split by groups, every thread read all of x, half of it from the
    // other core's cache: no faster on 2 threads than on 1)
    parallel_for(blocks, 1, [&](int64_t b0, int64_t b1, int tid) {
      const int64_t r0 = 32 * b0;
      gemm(t, x + r0 * t.cols, std::min<int64_t>(32 * b1, m) - r0, y + r0 * t.ldy, bias16, 0, t.ngroups,
           rows + tid * per_thread);
    });
  } else {  // few rows: the groups split across threads, one range each (each range converts the rows once)
    const int64_t per = (t_.ngroups + get_num_threads() - 1) / get_num_threads();
    parallel_for(t_.ngroups, per,
                 [&](int64_t g0, int64_t g1, int tid) { gemm(t, x, m, y, bias16, g0, g1, rows + tid * per_thread); });
  }
}

void Bf16TileMatrix::gelu_mlp(const Bf16TileMatrix& down, uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t up_biasp,
                              uintptr_t down_biasp, const std::string& approximate) const {
  if (down.cols() != rows())
    throw std::invalid_argument("gelu_mlp: the down projection takes " + std::to_string(down.cols()) +
                                " columns, the up projection gives " + std::to_string(rows()));
  if (approximate != "none" && approximate != "tanh")
    throw std::invalid_argument("gelu_mlp: approximate must be 'none' or 'tanh', got '" + approximate + "'");
  if (m < 0) throw std::invalid_argument("gelu_mlp: m must be >= 0");
  if (m == 0) return;
  const float* x = ptr<const float>(xp, "gelu_mlp: x");
  float* y = ptr<float>(yp, "gelu_mlp: y");
  const Bf16Tiles &up = t_, &dn = down.t_;
  g_bias_buf.reserve(size_t(up.ngroups + dn.ngroups) * 16 * 4);
  float* up_bias16 = reinterpret_cast<float*>(g_bias_buf.p);
  float* down_bias16 = up_bias16 + up.ngroups * 16;
  spread_bias(up, reinterpret_cast<const float*>(up_biasp), up_bias16);
  spread_bias(dn, reinterpret_cast<const float*>(down_biasp), down_bias16);
  const int64_t per_thread = 32 * up.kp + kMlpRows * dn.kp;  // bfloat16 of a thread's rows of x and activation
  g_rows_buf.reserve(size_t(per_thread * get_num_threads()) * 2);
  uint16_t* rows = reinterpret_cast<uint16_t*>(g_rows_buf.p);
  const auto mlp = tiles_->gelu_mlp_bf16_tiles;
  const bool tanh = approximate == "tanh";
  // blocks of rows split across threads: a block's activation stays in its thread's cache from the up projection
  // to the down one (32 rows or fewer run on one thread)
  parallel_for((m + 31) / 32, kMlpRows / 32, [&](int64_t b0, int64_t b1, int tid) {
    const int64_t r0 = 32 * b0;
    uint16_t* xb = rows + tid * per_thread;
    mlp(up, dn, x + r0 * up.cols, std::min<int64_t>(32 * b1, m) - r0, y + r0 * dn.ldy, up_bias16, down_bias16, tanh,
        xb, xb + 32 * up.kp);
  });
}

}  // namespace churon
