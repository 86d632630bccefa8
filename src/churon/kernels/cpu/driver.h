// What the parallel drivers around the kernels share (qmatrix.cpp, ops.cpp, repack.cpp):
// aligned scratch memory, addresses passed from Python, chunk sizes for parallel_for.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

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

}  // namespace churon
