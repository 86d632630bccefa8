// Which ISA's kernels run: each KernelTable compiled in (kernels.cpp, once per ISA) that this
// CPU can execute, and the one chosen now.
#pragma once

#include <string>
#include <vector>

#include "common.h"

namespace churon {

// ISAs compiled in and supported by this CPU, best first
std::vector<std::string> available_isas();

// switch every kernel to one ISA; std::invalid_argument when it is unknown or this CPU lacks it
void set_isa(const std::string& name);

// the kernels of the ISA chosen now
const KernelTable* kt();

// Whether a quantized matmul prefetches its weights into L2 8 KiB ahead of its read (kernels.cpp, ReadAhead)
// at every row count: on Intel CPUs, whose L3 and memory the hardware prefetchers alone serve slowly to one
// core (a SmolLM2 decode step reads its 50 MB from the Xeon's L3); elsewhere only with many rows, the next
// group (on AMD EPYC Zen 4 a prefetch for a few rows was slower). Decided once at import; never changes a
// result.
bool prefetch_weights_ahead();

// The kernels of the AMX-BF16 tiles (KernelTable::gemm_bf16_tiles, attn_packed_bf16_tiles): the amx table when
// it is the ISA chosen now, the CPU has the bfloat16 tiles and AVX512-BF16 (CPUID 7.0 EDX bit 22, 7.1 EAX bit 5)
// and Linux lets this process
// use tiles (asked here, for the whole process); null otherwise. Their results are those of no other kernel, so
// who uses them keeps using them (tile_matrix.h).
const KernelTable* bf16_tiles();

// At import: the best ISA this CPU supports, then CHURON_ISA if set. A bad CHURON_ISA keeps the
// best ISA and is reported, not fatal: returns why it was not applied (empty when it was, or unset).
std::string init_isa();

}  // namespace churon
