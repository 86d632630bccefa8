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

// the type whose x16 layout (and kernels) GGML type q is read into: Q5_0 into Q8_0's, exactly (a Q5_0
// value d * (L - 16), L in 0..31, is the Q8_0 code L - 16 with the same fp16 scale d per 32 columns);
// any other its own
int layout_qtype(int q);

// the GGUF rows src, of GGML type src_qtype, of the quantized matrix w (its layout's qtype and geometry
// set) into the x16 layout at dst, w.ngroups * w.group_bytes bytes; row groups in parallel
void repack_x16(const QWeights& w, int src_qtype, const uint8_t* src, uint8_t* dst);

}  // namespace churon
