// WeightMemory: where a QMatrix keeps its bytes. Matrices are packed one after another into
// 2 MiB-aligned slabs the kernel backs with transparent huge pages, rather than each in an
// allocation of its own.
//
// Why: a decode step streams every weight from DRAM once, and MoE layers (and small models) have
// hundreds of matrices under 2 MiB each (an expert's gate_up of 576 KB). Allocated alone, each sits
// on 4 KiB pages: a TLB miss every 4 KiB, and the hardware prefetchers stop at every page's end.
// Measured on a 2-vCPU Zen 5 EPYC: an MoE layer's four experts, cold, 136 -> 117 us a call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace churon {

class WeightMemory {
 public:
  WeightMemory() = default;
  // bytes, 64-byte aligned, in a slab shared with the matrices allocated before and after it; the
  // slab is freed with the last matrix in it
  explicit WeightMemory(size_t bytes);

  uint8_t* data() const { return p_; }

 private:
  std::shared_ptr<void> slab_;
  uint8_t* p_ = nullptr;
};

}  // namespace churon
