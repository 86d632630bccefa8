// What the parallel drivers around the kernels share (qmatrix.cpp, moe.cpp, ops.cpp, repack.cpp):
// aligned scratch memory, addresses passed from Python, chunk sizes for parallel_for, quantized
// activations.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common.h"
#include "threadpool.h"

namespace churon {

// aligned buffers
struct Buffer {
  uint8_t* p = nullptr;
  size_t n = 0;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { std::free(p); }
  void reserve(size_t bytes) {
    if (bytes <= n) return;
    std::free(p);
    p = nullptr;
    n = 0;
    const size_t align = bytes >= (size_t(2) << 20) ? (size_t(2) << 20) : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    void* q = nullptr;
    if (posix_memalign(&q, align, rounded) != 0 || !q) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align > 64) madvise(q, rounded, MADV_HUGEPAGE);
#endif
    p = static_cast<uint8_t*>(q);
    n = rounded;
  }
};

template <class T>
T* ptr(uintptr_t v, const char* what) {
  if (v == 0) throw std::invalid_argument(std::string(what) + " is a null pointer");
  return reinterpret_cast<T*>(v);
}

// chunk so that each thread gets several chunks (load balance when a core is busy)
inline int64_t chunk_for(int64_t n, int64_t min_chunk = 1) {
  const int64_t t = get_num_threads();
  return std::max<int64_t>(min_chunk, (n + 8 * t - 1) / (8 * t));
}

constexpr int64_t kParallelElems = 1 << 15;  // below this, a row op runs on the caller only

// f(begin, end) over rows [0, m) of n values each: in parallel when there are many values
template <class F>
void rows_op(int64_t m, int64_t n, F&& f) {
  if (m * n >= kParallelElems && m > 1)
    parallel_for(m, chunk_for(m), [&](int64_t b, int64_t e, int) { f(b, e); });
  else
    f(0, m);
}

// Row groups per claim in a matmul: ~11 KB of a 576-column Q4_1 matrix. (Measured: 1, 2, 4 and
// 8 are equal within noise; software prefetching in the matmul loop was slower.)
constexpr int64_t kMatmulGrain = 2;

// m rows of cols quantized activations laid out in buf (grown as needed; the rows' previous
// contents are not kept)
inline ActQ act_in(Buffer& buf, int64_t m, int64_t cols) {
  ActQ a;
  a.m = m;
  a.cols = cols;
  a.nb = cols / kActBlock;
  const size_t q_bytes = size_t(m * cols + 63) / 64 * 64;
  const size_t nbm = size_t(m * a.nb);
  const size_t f_bytes = (nbm * 4 + 63) / 64 * 64;
  buf.reserve(q_bytes + 3 * f_bytes + 2 * f_bytes);
  uint8_t* p = buf.p;
  a.q = reinterpret_cast<int8_t*>(p);
  p += q_bytes;
  a.d = reinterpret_cast<float*>(p);
  p += f_bytes;
  a.s = reinterpret_cast<float*>(p);
  p += f_bytes;
  a.sum32 = reinterpret_cast<int32_t*>(p);
  p += f_bytes;
  a.sum16 = reinterpret_cast<int32_t*>(p);
  return a;
}

// rows [r, r + m) of a as an ActQ of their own (row 0 is a's row r)
inline ActQ act_rows(const ActQ& a, int64_t r, int64_t m) {
  ActQ v = a;
  v.m = m;
  v.q += r * a.cols;
  v.d += r * a.nb;
  v.s += r * a.nb;
  v.sum32 += r * a.nb;
  v.sum16 += 2 * r * a.nb;
  return v;
}

// row j of dst = row i of src (same cols): a quantized row reused without quantizing it again
inline void copy_act_row(const ActQ& src, int64_t i, const ActQ& dst, int64_t j) {
  std::memcpy(dst.q + j * dst.cols, src.q + i * src.cols, size_t(src.cols));
  std::memcpy(dst.d + j * dst.nb, src.d + i * src.nb, size_t(src.nb) * 4);
  std::memcpy(dst.s + j * dst.nb, src.s + i * src.nb, size_t(src.nb) * 4);
  std::memcpy(dst.sum32 + j * dst.nb, src.sum32 + i * src.nb, size_t(src.nb) * 4);
  std::memcpy(dst.sum16 + 2 * j * dst.nb, src.sum16 + 2 * i * src.nb, size_t(src.nb) * 8);
}

// quantize activation rows [0, m) of x into a (in parallel when there are many)
inline void quantize_rows(const KernelTable* k, const float* x, int64_t m, const ActQ& a) {
  if (m * a.cols >= (1 << 16))
    parallel_for(m, std::max<int64_t>(1, m / (8 * get_num_threads())),
                 [&](int64_t b, int64_t e, int) { k->quantize_act(x, b, e, a); });
  else
    k->quantize_act(x, 0, m, a);
}

}  // namespace churon
