// WeightMemory (see weight_memory.h): a bump allocator over huge-page slabs.
#include "weight_memory.h"

#include <cstdlib>
#include <mutex>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace churon {
namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kSlab = size_t(32) << 20;  // 16 huge pages: a slab's unused end costs little

std::mutex g_mu;
std::weak_ptr<void> g_slab;  // the slab being filled; weak, so that it dies with its last matrix
uint8_t* g_next = nullptr;
uint8_t* g_end = nullptr;

std::shared_ptr<void> new_slab(size_t bytes) {
  void* q = nullptr;
  if (posix_memalign(&q, kHugePage, bytes) != 0 || !q) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(q, bytes, MADV_HUGEPAGE);  // advice: where THP is off, the slab is ordinary memory
#endif
  return std::shared_ptr<void>(q, std::free);
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

WeightMemory::WeightMemory(size_t bytes) {
  bytes = round_up(bytes, 64);
  if (bytes > kSlab / 4) {  // a large matrix (an output matrix) gets huge pages of its own
    slab_ = new_slab(round_up(bytes, kHugePage));
    p_ = static_cast<uint8_t*>(slab_.get());
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  std::shared_ptr<void> slab = g_slab.lock();
  if (!slab || size_t(g_end - g_next) < bytes) {
    slab = new_slab(kSlab);
    g_slab = slab;
    g_next = static_cast<uint8_t*>(slab.get());
    g_end = g_next + kSlab;
  }
  p_ = g_next;
  g_next += bytes;
  slab_ = std::move(slab);
}

}  // namespace churon
