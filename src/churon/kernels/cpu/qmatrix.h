// QMatrix: one weight matrix in the layout the kernels read (see common.h), and the parallel
// drivers of its matmul and dequantization.
#pragma once

#include <cstdint>
#include <string>

#include "common.h"
#include "driver.h"

namespace churon {

class QMatrix {
 public:
  // raw: the GGUF bytes of a [rows, cols] matrix of GGML type qtype, raw_bytes of them;
  // raw_contiguous: whether the buffer they came in is (else std::invalid_argument)
  QMatrix(const uint8_t* raw, int64_t raw_bytes, bool raw_contiguous, int qtype, int64_t rows, int64_t cols);

  int64_t rows() const { return w_.rows; }
  int64_t cols() const { return w_.cols; }
  int qtype() const { return qtype_; }  // the GGML type given (w_.qtype: its layout's)
  const std::string& layout() const { return layout_; }
  int64_t nbytes() const { return nbytes_; }

  bool quantized() const { return !(w_.qtype == kF32 || w_.qtype == kF16 || w_.qtype == kBF16); }

  void matmul(uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t biasp, bool precise);
  void dequantize(uintptr_t outp);
  void dequantize_bf16(uintptr_t outp);
  // out[i, :] = dequantized row ids[i] (an embedding lookup); ids int64
  void dequantize_rows(uintptr_t idsp, int64_t n, uintptr_t outp);

 private:
  int qtype_ = 0;
  QWeights w_;
  Buffer buf_;
  std::string layout_;
  int64_t nbytes_ = 0;
};

}  // namespace churon
