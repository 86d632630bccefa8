// GGUF weight blocks: their geometry, and their repacking into the x16 layout the kernels read
// (see common.h).
#pragma once

#include <cstdint>

#include "common.h"

namespace churon {

// "Q4_K" etc. for the GGML type ids QMatrix accepts, nullptr for any other
const char* qtype_name(int q);

// GGUF block geometry: values per block, bytes per block
void gguf_block(int q, int64_t& bs, int64_t& ts);

// the GGUF rows src of the quantized matrix w (its qtype and geometry set) into the x16 layout at dst,
// w.ngroups * w.group_bytes bytes; row groups in parallel
void repack_x16(const QWeights& w, const uint8_t* src, uint8_t* dst);

}  // namespace churon
