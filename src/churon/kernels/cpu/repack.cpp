// Repacking GGUF blocks into the x16 layout (see common.h).

#include "repack.h"

#include <cstring>

#include "driver.h"
#include "threadpool.h"

namespace churon {

const char* qtype_name(int q) {
  switch (q) {
    case kF32: return "F32";
    case kF16: return "F16";
    case kBF16: return "BF16";
    case kQ4_0: return "Q4_0";
    case kQ4_1: return "Q4_1";
    case kQ5_0: return "Q5_0";
    case kQ8_0: return "Q8_0";
    case kQ4_K: return "Q4_K";
    case kQ5_K: return "Q5_K";
    case kQ6_K: return "Q6_K";
    default: return nullptr;
  }
}

void gguf_block(int q, int64_t& bs, int64_t& ts) {
  switch (q) {
    case kF32: bs = 1; ts = 4; return;
    case kF16: case kBF16: bs = 1; ts = 2; return;
    case kQ4_0: bs = 32; ts = 18; return;
    case kQ4_1: bs = 32; ts = 20; return;
    case kQ5_0: bs = 32; ts = 22; return;
    case kQ8_0: bs = 32; ts = 34; return;
    case kQ4_K: bs = 256; ts = 144; return;
    case kQ5_K: bs = 256; ts = 176; return;
    case kQ6_K: bs = 256; ts = 210; return;
    default: bs = ts = 0; return;
  }
}

namespace {

// one row's GGUF block decoded to unsigned codes and raw scale fields
struct Decoded {
  uint8_t code[256];
  uint16_t d = 0, m = 0;   // fp16 bits: d / dmin (K) ; m (Q4_1)
  uint8_t sc[16], mn[8];   // K-quant 6-bit scales / mins; Q6_K: int8 scales (as bytes)
};

void k4_scale_min(const uint8_t* q, int j, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    mn = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void decode_block(int q, const uint8_t* b, Decoded& o) {
  switch (q) {
    case kQ4_0:
    case kQ4_1: {
      o.d = load_u16(b);
      const uint8_t* qs = b + (q == kQ4_0 ? 2 : 4);
      if (q == kQ4_1) o.m = load_u16(b + 2);
      for (int j = 0; j < 16; ++j) {
        o.code[j] = qs[j] & 15;
        o.code[j + 16] = qs[j] >> 4;
      }
      break;
    }
    case kQ8_0:
      o.d = load_u16(b);
      for (int j = 0; j < 32; ++j) o.code[j] = uint8_t(b[2 + j] ^ 0x80);  // int8 + 128
      break;
    case kQ5_0: {  // d | qh u32 (bit j: the 5th bit of value j) | qs[16] (values j, j + 16)
      o.d = load_u16(b);
      const uint32_t qh = uint32_t(load_i32(b + 2));
      const uint8_t* qs = b + 6;
      for (int j = 0; j < 16; ++j) {
        o.code[j] = uint8_t((qs[j] & 15) | ((qh >> j) & 1) << 4);
        o.code[j + 16] = uint8_t((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      o.d = load_u16(b);
      o.m = load_u16(b + 2);
      for (int j = 0; j < 8; ++j) k4_scale_min(b + 4, j, o.sc[j], o.mn[j]);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (q == kQ4_K ? 16 : 48);
      for (int s = 0; s < 8; ++s) {
        for (int c = 0; c < 32; ++c) {
          const uint8_t byte = qs[32 * (s / 2) + c];
          int v = (s & 1) ? (byte >> 4) : (byte & 15);
          if (q == kQ5_K) v |= ((qh[c] >> s) & 1) << 4;
          o.code[32 * s + c] = uint8_t(v);
        }
      }
      break;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      for (int n = 0; n < 2; ++n) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t h = qh[32 * n + l];
          const uint8_t a = ql[64 * n + l], c = ql[64 * n + l + 32];
          o.code[128 * n + l] = uint8_t((a & 15) | ((h & 3) << 4));
          o.code[128 * n + l + 32] = uint8_t((c & 15) | (((h >> 2) & 3) << 4));
          o.code[128 * n + l + 64] = uint8_t((a >> 4) | (((h >> 4) & 3) << 4));
          o.code[128 * n + l + 96] = uint8_t((c >> 4) | (((h >> 6) & 3) << 4));
        }
      }
      std::memcpy(o.sc, b + 192, 16);
      o.d = load_u16(b + 208);
      break;
    }
    default:
      break;
  }
}

// place the 4-bit codes of a 32-column sub-block of row r (codes[0..31])
inline void put_nibbles(uint8_t* P, int r, const uint8_t* codes) {
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < 4; ++t)
      P[64 * j + 4 * r + t] = uint8_t((codes[4 * j + t] & 15) | ((codes[16 + 4 * j + t] & 15) << 4));
}

// set the qh mask bits (common.h) of row r's 5-bit codes of a 32-column sub-block (codes[0..31])
inline void put_fifth_bits(uint8_t* qh, int r, const uint8_t* codes) {
  for (int c = 0; c < 32; ++c) {
    if (!(codes[c] & 16)) continue;
    const int v = c < 16 ? (c >> 2) : 4 + ((c - 16) >> 2);
    const int bit = 4 * r + (c & 3);
    qh[8 * v + (bit >> 3)] |= uint8_t(1u << (bit & 7));
  }
}

inline void put_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

void repack_unit(int q, uint8_t* P, int r, const Decoded& o) {
  switch (q) {
    case kQ4_0:
    case kQ4_1:
      put_nibbles(P, r, o.code);
      put_u16(P + 256 + 2 * r, o.d);
      if (q == kQ4_1) put_u16(P + 288 + 2 * r, o.m);
      break;
    case kQ5_0:
      put_nibbles(P, r, o.code);
      put_fifth_bits(P + kQ5Qh, r, o.code);
      put_u16(P + 320 + 2 * r, o.d);
      break;
    case kQ8_0:
      for (int c = 0; c < 32; ++c) P[64 * (c >> 2) + 4 * r + (c & 3)] = o.code[c];
      put_u16(P + 512 + 2 * r, o.d);
      break;
    case kQ4_K:
    case kQ5_K:
      for (int s = 0; s < 8; ++s) {
        uint8_t* sb = P + kq_head(q) + s * kq_sb(q);
        put_nibbles(sb, r, o.code + 32 * s);
        sb[kq_sc(q) + r] = o.sc[s];
        sb[kq_mn(q) + r] = o.mn[s];
        if (q == kQ5_K) put_fifth_bits(sb + kQ5Qh, r, o.code + 32 * s);
      }
      put_u16(P + 2 * r, o.d);
      put_u16(P + 32 + 2 * r, o.m);
      break;
    case kQ6_K:
      for (int s = 0; s < 8; ++s) {
        uint8_t* sb = P + kq_head(q) + s * kq_sb(q);
        put_nibbles(sb, r, o.code + 32 * s);
        for (int c = 0; c < 32; ++c) {
          const int h = c < 16 ? 0 : 1;
          const int k = (c & 15) >> 2;
          sb[kQ6Hb + 64 * h + 4 * r + (c & 3)] |= uint8_t(((o.code[32 * s + c] >> 4) & 3) << (2 * k));
        }
        sb[kq_sc(q) + r] = o.sc[2 * s];
        sb[kq_sc(q) + 16 + r] = o.sc[2 * s + 1];
      }
      put_u16(P + 2 * r, o.d);
      break;
    default:
      break;
  }
}

}  // namespace

void repack_x16(const QWeights& w, const uint8_t* src, uint8_t* dst) {
  int64_t bs, ts;
  gguf_block(w.qtype, bs, ts);
  const int64_t nblocks = w.cols / bs;  // GGUF blocks per row (= nunits)
  auto work = [&](int64_t g0, int64_t g1, int) {
    Decoded o;
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* gp = dst + g * w.group_bytes;
      std::memset(gp, 0, size_t(w.group_bytes));
      for (int r = 0; r < kGroupRows; ++r) {
        const int64_t row = g * kGroupRows + r;
        if (row >= w.rows) break;  // padding rows stay zero (codes 0, scales +0.0)
        for (int64_t u = 0; u < nblocks; ++u) {
          decode_block(w.qtype, src + (row * nblocks + u) * ts, o);
          repack_unit(w.qtype, gp + u * w.unit_bytes, r, o);
        }
      }
    }
  };
  parallel_for(w.ngroups, chunk_for(w.ngroups), work);
}

}  // namespace churon
