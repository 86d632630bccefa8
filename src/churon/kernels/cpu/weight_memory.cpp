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

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// A slab is mapped afresh, never taken from malloc: glibc serves even a 32 MiB request from its heap once its
// mmap threshold has grown (after large frees), with pages already touched as 4 KiB ones, and the advice would
// come too late for them (measured: 0 huge pages for 27 MB of matrices after a few hundred tests had run)
std::shared_ptr<void> new_slab(size_t bytes) {
#if defined(__linux__)
  const size_t mapped = bytes + kHugePage;  // room to align the start to a huge page
  void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) throw std::bad_alloc();
  uint8_t* base = static_cast<uint8_t*>(m);
  uint8_t* start = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uintptr_t>(base), kHugePage));
  if (start > base) munmap(base, size_t(start - base));
  if (start + bytes < base + mapped) munmap(start + bytes, size_t(base + mapped - (start + bytes)));
#if defined(MADV_HUGEPAGE)
  madvise(start, bytes, MADV_HUGEPAGE);  // advice: where THP is off, the slab is ordinary memory
#endif
  return std::shared_ptr<void>(start, [bytes](void* p) { munmap(p, bytes); });
#else
  void* q = nullptr;
  if (posix_memalign(&q, kHugePage, bytes) != 0 || !q) throw std::bad_alloc();
  return std::shared_ptr<void>(q, std::free);
#endif
}

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
