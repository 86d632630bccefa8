// Bf16TileMatrix: a float matrix rounded to bfloat16 and packed for the AMX-BF16 tiles
// (matmul_amx_bf16.inc), and the parallel drivers of its matmul and of the GELU MLP it makes with a
// second one. Built only where bf16_tiles() (isa.h) is available; every matmul of it runs on the tiles,
// for every row count, so a row's result never depends on the rows it is computed with.
#pragma once

#include <cstdint>
#include <string>

#include "common.h"
#include "isa.h"
#include "weight_memory.h"

namespace churon {

class Bf16TileMatrix {
 public:
  // w: a [rows, cols] float32 matrix, C-contiguous (raw_bytes of it); std::invalid_argument when the
  // shape does not match, or when the tiles are not available here
  Bf16TileMatrix(const float* w, int64_t raw_bytes, bool raw_contiguous, int64_t rows, int64_t cols);

  int64_t rows() const { return t_.rows; }
  int64_t cols() const { return t_.cols; }
  int64_t nbytes() const { return t_.ngroups * t_.kp * 16 * 2; }
  std::string layout() const;

  // y[m, rows] = bf16(x[m, cols]) @ bf16(W)^T (+ bias[rows]), summed in float32; float32, C-contiguous
  void matmul(uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t biasp) const;

  // y[m, down.rows] = bf16(gelu(x @ this^T + up_bias)) @ bf16(down)^T + down_bias, as matmul does each, the gelu
  // within 5e-7 (approximate "none": erf, or "tanh"), in one pass over kMlpRows rows at a time; biases may be 0
  void gelu_mlp(const Bf16TileMatrix& down, uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t up_biasp,
                uintptr_t down_biasp, const std::string& approximate) const;

 private:
  Bf16Tiles t_;
  WeightMemory mem_;
  const KernelTable* tiles_ = nullptr;  // bf16_tiles() when built
};

}  // namespace churon
