// churon CPU kernels, one ISA per compilation.
//
// setup.py compiles this file several times: -DCHURON_ISA=scalar with baseline flags,
// -DCHURON_ISA=avx2 with -mavx2 -mfma -mf16c, -DCHURON_ISA=avx512 with the AVX-512
// F/BW/VL/DQ/VNNI flags. Each copy defines churon::<isa>::table(); module.cpp picks one at
// run time. Code paths below are chosen by the compiler's predefined ISA macros; what is
// not specialised is plain C++ that each copy compiles (and auto-vectorises) for its ISA.
//
// Everything lives in an anonymous namespace (internal linkage) and uses no out-of-line
// library templates, so no symbol compiled with AVX-512 can be shared with a baseline TU.
//
// Numerics: all files are compiled with -ffp-contract=off, so a*b+c is two roundings unless
// an FMA intrinsic is written. Every kernel computes a given output row with the same
// sequence of operations whatever the row range, the thread, or the number of rows M it is
// batched with (the batch-invariance requirement).

#include <cmath>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define K_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define K_AVX2 1
#include <immintrin.h>
#endif

#ifndef CHURON_ISA
#error "compile with -DCHURON_ISA=<scalar|avx2|avx512>"
#endif

#define CHURON_STR2(x) #x
#define CHURON_STR(x) CHURON_STR2(x)

namespace churon {
namespace CHURON_ISA {
namespace {

template <class T>
inline T imin(T a, T b) { return a < b ? a : b; }
template <class T>
inline T imax(T a, T b) { return a < b ? b : a; }

// ===========================================================================
// Decoding one value of the repacked layout (portable; used by dequantize and the scalar
// matmul).

// 4-bit code of row r, column c (0..31) of a sub-block's 256 nibble bytes
inline int nib(const uint8_t* P, int r, int c) {
  if (c < 16) return P[64 * (c >> 2) + 4 * r + (c & 3)] & 15;
  c -= 16;
  return P[64 * (c >> 2) + 4 * r + (c & 3)] >> 4;
}

// Q5_K 5th bit of row r, column c (0..31) from a sub-block's qh masks
inline int q5k_bit(const uint8_t* qh, int r, int c) {
  const int v = c < 16 ? (c >> 2) : 4 + ((c - 16) >> 2);
  const uint64_t mask = load_u64(qh + 8 * v);
  return int((mask >> (4 * r + (c & 3))) & 1);
}

// Q6_K top two bits of row r, column c from a sub-block's hbits
inline int q6k_hi(const uint8_t* hb, int r, int c) {
  const int h = c < 16 ? 0 : 1;
  const int k = (c & 15) >> 2;
  const uint8_t byte = hb[64 * h + 4 * r + (c & 3)];
  return (byte >> (2 * k)) & 3;
}

// Dequantize one row's unit u into out[unit_cols], with ggml's exact operation order.
void decode_unit(const QWeights& w, int64_t row, int64_t u, float* out) {
  const int64_t g = row / kGroupRows;
  const int r = int(row % kGroupRows);
  const uint8_t* p = w.data + g * w.group_bytes + u * w.unit_bytes;
  switch (w.qtype) {
    case kQ4_0: {
      const float d = fp16_to_fp32(load_u16(p + 256 + 2 * r));
      for (int c = 0; c < 32; ++c) out[c] = float(nib(p, r, c) - 8) * d;
      break;
    }
    case kQ4_1: {
      const float d = fp16_to_fp32(load_u16(p + 256 + 2 * r));
      const float m = fp16_to_fp32(load_u16(p + 288 + 2 * r));
      for (int c = 0; c < 32; ++c) out[c] = float(nib(p, r, c)) * d + m;
      break;
    }
    case kQ8_0: {
      const float d = fp16_to_fp32(load_u16(p + 512 + 2 * r));
      for (int c = 0; c < 32; ++c) out[c] = float(int(p[64 * (c >> 2) + 4 * r + (c & 3)]) - 128) * d;
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const int qt = w.qtype;
      const float d = fp16_to_fp32(load_u16(p + 2 * r));
      const float dmin = fp16_to_fp32(load_u16(p + 32 + 2 * r));
      for (int s = 0; s < 8; ++s) {
        const uint8_t* sb = p + kq_head(qt) + s * kq_sb(qt);
        const float sc = d * float(sb[kq_sc(qt) + r]);
        const float mn = dmin * float(sb[kq_mn(qt) + r]);
        for (int c = 0; c < 32; ++c) {
          int q = nib(sb, r, c);
          if (qt == kQ5_K) q |= q5k_bit(sb + kQ5Qh, r, c) << 4;
          out[32 * s + c] = sc * float(q) - mn;
        }
      }
      break;
    }
    case kQ6_K: {
      const float d = fp16_to_fp32(load_u16(p + 2 * r));
      for (int s = 0; s < 8; ++s) {
        const uint8_t* sb = p + kq_head(kQ6_K) + s * kq_sb(kQ6_K);
        for (int h = 0; h < 2; ++h) {
          const float sc = d * float(int8_t(sb[kq_sc(kQ6_K) + 16 * h + r]));
          for (int c = 16 * h; c < 16 * h + 16; ++c) {
            const int q = nib(sb, r, c) | (q6k_hi(sb + kQ6Hb, r, c) << 4);
            out[32 * s + c] = sc * float(q - 32);
          }
        }
      }
      break;
    }
    default:
      break;
  }
}

inline float float_weight(const QWeights& w, const uint8_t* row, int64_t k) {
  switch (w.qtype) {
    case kF16: return fp16_to_fp32(load_u16(row + 2 * k));
    case kBF16: return bf16_to_fp32(load_u16(row + 2 * k));
    default: { float f; std::memcpy(&f, row + 4 * k, 4); return f; }
  }
}

void dequant_rows(const QWeights& w, int64_t r0, int64_t r1, float* out) {
  for (int64_t r = r0; r < r1; ++r) {
    float* o = out + (r - r0) * w.cols;
    if (w.qtype == kF32 || w.qtype == kF16 || w.qtype == kBF16) {
      const uint8_t* row = w.data + r * w.unit_bytes;
      if (w.qtype == kF32) {
        std::memcpy(o, row, size_t(w.cols) * 4);
      } else {
        for (int64_t k = 0; k < w.cols; ++k) o[k] = float_weight(w, row, k);
      }
      continue;
    }
    for (int64_t u = 0; u < w.nunits; ++u) decode_unit(w, r, u, o + u * w.unit_cols);
  }
}

void dequant_rows_bf16(const QWeights& w, int64_t r0, int64_t r1, uint16_t* out) {
  float tmp[256];
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* o = out + (r - r0) * w.cols;
    if (w.qtype == kF32 || w.qtype == kF16 || w.qtype == kBF16) {
      const uint8_t* row = w.data + r * w.unit_bytes;
      for (int64_t k = 0; k < w.cols; ++k) o[k] = fp32_to_bf16(float_weight(w, row, k));
      continue;
    }
    for (int64_t u = 0; u < w.nunits; ++u) {
      decode_unit(w, r, u, tmp);
      for (int64_t c = 0; c < w.unit_cols; ++c) o[u * w.unit_cols + c] = fp32_to_bf16(tmp[c]);
    }
  }
}

// ===========================================================================
// Activation quantization

void quantize_act(const float* x, int64_t m0, int64_t m1, const ActQ& a) {
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < a.nb; ++b) {
      const float* xb = x + m * a.cols + b * 32;
      int8_t* qb = a.q + m * a.cols + b * 32;
#if defined(K_AVX512)
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const __m512 am = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
      const float amax = _mm512_reduce_max_ps(am);
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      const __m512 vid = _mm512_set1_ps(id);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
      _mm_storeu_si128((__m128i*)qb, _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128((__m128i*)(qb + 16), _mm512_cvtsepi32_epi8(q1));
      const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
#elif defined(K_AVX2)
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 v[4];
      __m256 am = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        am = _mm256_max_ps(am, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float amax = _mm_cvtss_f32(h);
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      const __m256 vid = _mm256_set1_ps(id);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
      // pack int32 -> int8 (saturating); packs work per 128-bit lane, fix the order after
      const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
      const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
      __m256i p = _mm256_packs_epi16(p01, p23);
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)qb, p);
      auto hsum = [](__m256i a, __m256i b) {
        __m256i s = _mm256_add_epi32(a, b);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        return _mm_cvtsi128_si32(t);
      };
      const int32_t s0 = hsum(q[0], q[1]), s1 = hsum(q[2], q[3]);
#else
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = imax(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t s0 = 0, s1 = 0;
      for (int i = 0; i < 32; ++i) {
        float qf = std::nearbyint(xb[i] * id);
        qf = imin(127.0f, imax(-128.0f, qf));
        const int q = int(qf);
        qb[i] = int8_t(q);
        (i < 16 ? s0 : s1) += q;
      }
#endif
      const int64_t i = m * a.nb + b;
      a.d[i] = d;
      a.sum32[i] = s0 + s1;
      a.sum16[2 * i] = s0;
      a.sum16[2 * i + 1] = s1;
      a.s[i] = d * float(s0 + s1);
    }
  }
}

// ===========================================================================
// Quantized matmul

inline void store_rows(float* y, const float* vals, int nvalid, const float* bias) {
  for (int r = 0; r < nvalid; ++r) y[r] = bias ? vals[r] + bias[r] : vals[r];
}

#if defined(K_AVX512)

inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }
inline __m512 cvt_f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

template <int T>
inline void store_tile(float* y, int64_t ldy, int64_t m0, int64_t r0, int nvalid, const float* bias,
                       const __m512 (&acc)[T]) {
  const __mmask16 k = nvalid >= 16 ? __mmask16(0xffff) : __mmask16((1u << nvalid) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + r0) : _mm512_setzero_ps();
  for (int t = 0; t < T; ++t) {
    __m512 v = bias ? _mm512_add_ps(acc[t], bv) : acc[t];
    _mm512_mask_storeu_ps(y + (m0 + t) * ldy + r0, k, v);
  }
}

// Q4_0, Q4_1, Q8_0: one group of 16 rows x T activation rows
template <int QT, int T>
void tile32(const uint8_t* gp, int64_t nunits, const ActQ& a, int64_t m0, __m512 (&acc)[T]) {
  constexpr int64_t UB = QT == kQ4_0 ? 288 : QT == kQ4_1 ? 320 : 544;
  constexpr int SCALE_OFF = QT == kQ8_0 ? 512 : 256;
  constexpr bool split = T <= 2;  // two integer chains per row when few rows (latency)
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const int8_t* xq[T];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm512_setzero_ps();
    xq[t] = a.q + (m0 + t) * a.cols;
  }
  for (int64_t b = 0; b < nunits; ++b) {
    const uint8_t* p = gp + b * UB;
    __m512i i0[T], i1[T];
    for (int t = 0; t < T; ++t) i0[t] = i1[t] = _mm512_setzero_si512();
    if constexpr (QT == kQ8_0) {
      for (int j = 0; j < 8; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);
        for (int t = 0; t < T; ++t) {
          if (split && (j & 1))
            i1[t] = _mm512_dpbusd_epi32(i1[t], v, bcast4(xq[t] + 32 * b + 4 * j));
          else
            i0[t] = _mm512_dpbusd_epi32(i0[t], v, bcast4(xq[t] + 32 * b + 4 * j));
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(p + 64 * j);
        const __m512i lo = _mm512_and_si512(v, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        for (int t = 0; t < T; ++t) {
          i0[t] = _mm512_dpbusd_epi32(i0[t], lo, bcast4(xq[t] + 32 * b + 4 * j));
          if (split)
            i1[t] = _mm512_dpbusd_epi32(i1[t], hi, bcast4(xq[t] + 32 * b + 16 + 4 * j));
          else
            i0[t] = _mm512_dpbusd_epi32(i0[t], hi, bcast4(xq[t] + 32 * b + 16 + 4 * j));
        }
      }
    }
    const __m512 dw = cvt_f16x16(p + SCALE_OFF);
    for (int t = 0; t < T; ++t) {
      const int64_t ai = (m0 + t) * a.nb + b;
      __m512i is = split ? _mm512_add_epi32(i0[t], i1[t]) : i0[t];
      if constexpr (QT == kQ4_0) is = _mm512_sub_epi32(is, _mm512_set1_epi32(8 * a.sum32[ai]));
      if constexpr (QT == kQ8_0) is = _mm512_sub_epi32(is, _mm512_set1_epi32(128 * a.sum32[ai]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[ai])), acc[t]);
      if constexpr (QT == kQ4_1)
        acc[t] = _mm512_fmadd_ps(cvt_f16x16(p + 288), _mm512_set1_ps(a.s[ai]), acc[t]);
    }
  }
}

// Q4_K, Q5_K, Q6_K: one group of 16 rows x T activation rows
template <int QT, int T>
void tileK(const uint8_t* gp, int64_t nunits, const ActQ& a, int64_t m0, __m512 (&acc)[T]) {
  constexpr int64_t UB = QT == kQ4_K ? 2368 : QT == kQ5_K ? 2880 : 3360;
  constexpr int HEAD = kq_head(QT), SB = kq_sb(QT), SC = kq_sc(QT);
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  const __m512i m30 = _mm512_set1_epi8(0x30);
  const __m512i sixteen = _mm512_set1_epi8(16);
  const int8_t* xq[T];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm512_setzero_ps();
    xq[t] = a.q + (m0 + t) * a.cols;
  }
  for (int64_t u = 0; u < nunits; ++u) {
    const uint8_t* p = gp + u * UB;
    const __m512 d = cvt_f16x16(p);
    if constexpr (QT == kQ6_K) {
      for (int s = 0; s < 8; ++s) {
        const int64_t blk = u * 8 + s;
        const uint8_t* sb = p + HEAD + s * SB;
        const __m512i h0 = _mm512_loadu_si512(sb + kQ6Hb);
        const __m512i h1 = _mm512_loadu_si512(sb + kQ6Hb + 64);
        __m512i il[T], ih[T];
        for (int t = 0; t < T; ++t) il[t] = ih[t] = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(sb + 64 * j);
          __m512i a0, a1;
          switch (j) {
            case 0: a0 = _mm512_slli_epi16(h0, 4); a1 = _mm512_slli_epi16(h1, 4); break;
            case 1: a0 = _mm512_slli_epi16(h0, 2); a1 = _mm512_slli_epi16(h1, 2); break;
            case 2: a0 = h0; a1 = h1; break;
            default: a0 = _mm512_srli_epi16(h0, 2); a1 = _mm512_srli_epi16(h1, 2); break;
          }
          // lo = (v & 0x0f) | (a0 & 0x30) ; hi = ((v >> 4) & 0x0f) | (a1 & 0x30)
          const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(v, m4), a0, m30, 0xF8);
          const __m512i hi = _mm512_ternarylogic_epi32(
              _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), a1, m30, 0xF8);
          for (int t = 0; t < T; ++t) {
            il[t] = _mm512_dpbusd_epi32(il[t], lo, bcast4(xq[t] + 32 * blk + 4 * j));
            ih[t] = _mm512_dpbusd_epi32(ih[t], hi, bcast4(xq[t] + 32 * blk + 16 + 4 * j));
          }
        }
        const __m512 sl = _mm512_mul_ps(
            d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sb + SC)))));
        const __m512 sh = _mm512_mul_ps(
            d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sb + SC + 16)))));
        for (int t = 0; t < T; ++t) {
          const int64_t ai = (m0 + t) * a.nb + blk;
          const __m512 dx = _mm512_set1_ps(a.d[ai]);
          const __m512i l = _mm512_sub_epi32(il[t], _mm512_set1_epi32(32 * a.sum16[2 * ai]));
          const __m512i h = _mm512_sub_epi32(ih[t], _mm512_set1_epi32(32 * a.sum16[2 * ai + 1]));
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), _mm512_mul_ps(sl, dx), acc[t]);
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_mul_ps(sh, dx), acc[t]);
        }
      }
    } else {
      const __m512 dmin = cvt_f16x16(p + 32);
      for (int s = 0; s < 8; ++s) {
        const int64_t blk = u * 8 + s;
        const uint8_t* sb = p + HEAD + s * SB;
        __m512i is[T];
        for (int t = 0; t < T; ++t) is[t] = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(sb + 64 * j);
          __m512i lo = _mm512_and_si512(v, m4);
          __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
          if constexpr (QT == kQ5_K) {
            lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(load_u64(sb + kQ5Qh + 8 * j)), lo, sixteen);
            hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(load_u64(sb + kQ5Qh + 8 * (4 + j))), hi, sixteen);
          }
          for (int t = 0; t < T; ++t) {
            is[t] = _mm512_dpbusd_epi32(is[t], lo, bcast4(xq[t] + 32 * blk + 4 * j));
            is[t] = _mm512_dpbusd_epi32(is[t], hi, bcast4(xq[t] + 32 * blk + 16 + 4 * j));
          }
        }
        const __m512 sc = _mm512_mul_ps(
            d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sb + SC)))));
        const __m512 mn = _mm512_mul_ps(
            dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(sb + SC + 16)))));
        for (int t = 0; t < T; ++t) {
          const int64_t ai = (m0 + t) * a.nb + blk;
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[t]), _mm512_mul_ps(sc, _mm512_set1_ps(a.d[ai])), acc[t]);
          acc[t] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a.s[ai]), acc[t]);
        }
      }
    }
  }
}

template <int QT, int T>
inline void run_tile(const QWeights& w, const ActQ& a, int64_t g, int64_t m0, float* y, const float* bias) {
  __m512 acc[T];
  const uint8_t* gp = w.data + g * w.group_bytes;
  if constexpr (QT == kQ4_0 || QT == kQ4_1 || QT == kQ8_0)
    tile32<QT, T>(gp, w.nunits, a, m0, acc);
  else
    tileK<QT, T>(gp, w.nunits, a, m0, acc);
  const int64_t r0 = g * kGroupRows;
  store_tile<T>(y, w.rows, m0, r0, int(imin<int64_t>(kGroupRows, w.rows - r0)), bias, acc);
}

constexpr int kMaxTile = 8;

#elif defined(K_AVX2)

inline __m256i bcast4(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }
inline __m256 cvt_f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
// u8 x s8 -> int32 per 4 bytes (no saturation for codes up to 63)
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
// 32 bits -> 32 bytes, 0xff where the bit is set
inline __m256i expand_bits(uint32_t m) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(m)), shuf);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

template <int T>
inline void store_tile(float* y, int64_t ldy, int64_t m0, int64_t r0, int nvalid, const float* bias,
                       const __m256 (&acc)[T][2]) {
  for (int t = 0; t < T; ++t) {
    float* yr = y + (m0 + t) * ldy + r0;
    if (nvalid == 16 && !bias) {
      _mm256_storeu_ps(yr, acc[t][0]);
      _mm256_storeu_ps(yr + 8, acc[t][1]);
    } else {
      alignas(32) float tmp[16];
      _mm256_store_ps(tmp, acc[t][0]);
      _mm256_store_ps(tmp + 8, acc[t][1]);
      store_rows(yr, tmp, nvalid, bias ? bias + r0 : nullptr);
    }
  }
}

// one group of 16 rows (two halves of 8) x T activation rows, all quantized types
template <int QT, int T>
void tileq(const uint8_t* gp, int64_t nunits, const ActQ& a, int64_t m0, __m256 (&acc)[T][2]) {
  constexpr bool K = QT == kQ4_K || QT == kQ5_K || QT == kQ6_K;
  constexpr int64_t UB = QT == kQ4_0 ? 288 : QT == kQ4_1 ? 320 : QT == kQ8_0 ? 544
                       : QT == kQ4_K ? 2368 : QT == kQ5_K ? 2880 : 3360;
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  const __m256i m30 = _mm256_set1_epi8(0x30);
  const __m256i sixteen = _mm256_set1_epi8(16);
  const int8_t* xq[T];
  for (int t = 0; t < T; ++t) {
    acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    xq[t] = a.q + (m0 + t) * a.cols;
  }
  const int subs = K ? 8 : 1;
  for (int64_t u = 0; u < nunits; ++u) {
    const uint8_t* p = gp + u * UB;
    for (int s = 0; s < subs; ++s) {
      const int64_t blk = u * subs + s;
      for (int hf = 0; hf < 2; ++hf) {  // rows 8*hf .. 8*hf+7 = bytes 32*hf .. 32*hf+31
        __m256i il[T], ih[T];
        for (int t = 0; t < T; ++t) il[t] = ih[t] = _mm256_setzero_si256();
        if constexpr (QT == kQ8_0) {
          for (int j = 0; j < 8; ++j) {
            const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 64 * j + 32 * hf)),
                                               _mm256_set1_epi8(char(0x80)));  // signed code
            const __m256i av = _mm256_sign_epi8(v, v);  // |w| as u8
            for (int t = 0; t < T; ++t)
              il[t] = dot4(il[t], av, _mm256_sign_epi8(bcast4(xq[t] + 32 * blk + 4 * j), v));
          }
        } else {
          const uint8_t* nb = K ? p + kq_head(QT) + s * kq_sb(QT) : p;  // the sub-block
          __m256i h0 = _mm256_setzero_si256(), h1 = h0;
          if constexpr (QT == kQ6_K) {
            h0 = _mm256_loadu_si256((const __m256i*)(nb + kQ6Hb + 32 * hf));
            h1 = _mm256_loadu_si256((const __m256i*)(nb + kQ6Hb + 64 + 32 * hf));
          }
          for (int j = 0; j < 4; ++j) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(nb + 64 * j + 32 * hf));
            __m256i lo = _mm256_and_si256(v, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if constexpr (QT == kQ5_K) {
              const uint8_t* qh = nb + kQ5Qh;
              const uint32_t ml = uint32_t(load_u64(qh + 8 * j) >> (32 * hf));
              const uint32_t mh = uint32_t(load_u64(qh + 8 * (4 + j)) >> (32 * hf));
              lo = _mm256_or_si256(lo, _mm256_and_si256(expand_bits(ml), sixteen));
              hi = _mm256_or_si256(hi, _mm256_and_si256(expand_bits(mh), sixteen));
            }
            if constexpr (QT == kQ6_K) {
              __m256i a0, a1;
              switch (j) {
                case 0: a0 = _mm256_slli_epi16(h0, 4); a1 = _mm256_slli_epi16(h1, 4); break;
                case 1: a0 = _mm256_slli_epi16(h0, 2); a1 = _mm256_slli_epi16(h1, 2); break;
                case 2: a0 = h0; a1 = h1; break;
                default: a0 = _mm256_srli_epi16(h0, 2); a1 = _mm256_srli_epi16(h1, 2); break;
              }
              lo = _mm256_or_si256(lo, _mm256_and_si256(a0, m30));
              hi = _mm256_or_si256(hi, _mm256_and_si256(a1, m30));
            }
            for (int t = 0; t < T; ++t) {
              il[t] = dot4(il[t], lo, bcast4(xq[t] + 32 * blk + 4 * j));
              ih[t] = dot4(ih[t], hi, bcast4(xq[t] + 32 * blk + 16 + 4 * j));
            }
          }
        }
        // float update for this half
        __m256 dw = _mm256_setzero_ps(), mw = dw, sl = dw, sh = dw;
        if constexpr (QT == kQ4_0 || QT == kQ4_1) dw = cvt_f16x8(p + 256 + 16 * hf);
        if constexpr (QT == kQ4_1) mw = cvt_f16x8(p + 288 + 16 * hf);
        if constexpr (QT == kQ8_0) dw = cvt_f16x8(p + 512 + 16 * hf);
        if constexpr (QT == kQ4_K || QT == kQ5_K) {
          const uint8_t* sb = p + kq_head(QT) + s * kq_sb(QT);
          const __m256 d = cvt_f16x8(p + 16 * hf), dmin = cvt_f16x8(p + 32 + 16 * hf);
          dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sb + kq_sc(QT) + 8 * hf)))));
          mw = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sb + kq_mn(QT) + 8 * hf)))));
        }
        if constexpr (QT == kQ6_K) {
          const uint8_t* sb = p + kq_head(QT) + s * kq_sb(QT);
          const __m256 d = cvt_f16x8(p + 16 * hf);
          sl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sb + kq_sc(QT) + 8 * hf)))));
          sh = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(sb + kq_sc(QT) + 16 + 8 * hf)))));
        }
        for (int t = 0; t < T; ++t) {
          const int64_t ai = (m0 + t) * a.nb + blk;
          const __m256 dx = _mm256_set1_ps(a.d[ai]);
          __m256& ac = acc[t][hf];
          if constexpr (QT == kQ6_K) {
            const __m256i l = _mm256_sub_epi32(il[t], _mm256_set1_epi32(32 * a.sum16[2 * ai]));
            const __m256i h = _mm256_sub_epi32(ih[t], _mm256_set1_epi32(32 * a.sum16[2 * ai + 1]));
            ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), _mm256_mul_ps(sl, dx), ac);
            ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(sh, dx), ac);
          } else {
            __m256i is = _mm256_add_epi32(il[t], ih[t]);
            if constexpr (QT == kQ4_0) is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * a.sum32[ai]));
            ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(dw, dx), ac);
            if constexpr (QT == kQ4_1) ac = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s[ai]), ac);
            if constexpr (QT == kQ4_K || QT == kQ5_K) ac = _mm256_fnmadd_ps(mw, _mm256_set1_ps(a.s[ai]), ac);
          }
        }
      }
    }
  }
}

template <int QT, int T>
inline void run_tile(const QWeights& w, const ActQ& a, int64_t g, int64_t m0, float* y, const float* bias) {
  __m256 acc[T][2];
  tileq<QT, T>(w.data + g * w.group_bytes, w.nunits, a, m0, acc);
  const int64_t r0 = g * kGroupRows;
  store_tile<T>(y, w.rows, m0, r0, int(imin<int64_t>(kGroupRows, w.rows - r0)), bias, acc);
}

constexpr int kMaxTile = 2;

#else  // scalar

// integer dot of row r of a 32-column sub-block with activation codes xb, plus the per-type
// float update; one row, one activation row at a time.
template <int QT, int T>
inline void run_tile(const QWeights& w, const ActQ& a, int64_t g, int64_t m0, float* y, const float* bias) {
  const uint8_t* gp = w.data + g * w.group_bytes;
  const int64_t r0 = g * kGroupRows;
  const int nvalid = int(imin<int64_t>(kGroupRows, w.rows - r0));
  for (int t = 0; t < T; ++t) {
    const int64_t m = m0 + t;
    const int8_t* xq = a.q + m * a.cols;
    for (int r = 0; r < nvalid; ++r) {
      float acc = 0.0f;
      for (int64_t u = 0; u < w.nunits; ++u) {
        const uint8_t* p = gp + u * w.unit_bytes;
        if constexpr (QT == kQ4_0 || QT == kQ4_1 || QT == kQ8_0) {
          const int64_t ai = m * a.nb + u;
          const int8_t* xb = xq + 32 * u;
          int32_t is = 0;
          for (int c = 0; c < 32; ++c) {
            const int q = QT == kQ8_0 ? int(p[64 * (c >> 2) + 4 * r + (c & 3)]) : nib(p, r, c);
            is += q * xb[c];
          }
          if (QT == kQ4_0) is -= 8 * a.sum32[ai];
          if (QT == kQ8_0) is -= 128 * a.sum32[ai];
          const float dw = fp16_to_fp32(load_u16(p + (QT == kQ8_0 ? 512 : 256) + 2 * r));
          acc = acc + float(is) * (dw * a.d[ai]);
          if (QT == kQ4_1) acc = acc + fp16_to_fp32(load_u16(p + 288 + 2 * r)) * a.s[ai];
        } else {
          const float d = fp16_to_fp32(load_u16(p + 2 * r));
          const float dmin = QT == kQ6_K ? 0.0f : fp16_to_fp32(load_u16(p + 32 + 2 * r));
          for (int s = 0; s < 8; ++s) {
            const int64_t ai = m * a.nb + u * 8 + s;
            const int8_t* xb = xq + 32 * (u * 8 + s);
            const uint8_t* sb = p + kq_head(QT) + s * kq_sb(QT);
            int32_t il = 0, ih = 0;
            for (int c = 0; c < 32; ++c) {
              int q = nib(sb, r, c);
              if (QT == kQ5_K) q |= q5k_bit(sb + kQ5Qh, r, c) << 4;
              if (QT == kQ6_K) q |= q6k_hi(sb + kQ6Hb, r, c) << 4;
              (c < 16 ? il : ih) += q * xb[c];
            }
            if constexpr (QT == kQ6_K) {
              il -= 32 * a.sum16[2 * ai];
              ih -= 32 * a.sum16[2 * ai + 1];
              const float sl = d * float(int8_t(sb[kq_sc(QT) + r]));
              const float sh = d * float(int8_t(sb[kq_sc(QT) + 16 + r]));
              acc = acc + float(il) * (sl * a.d[ai]);
              acc = acc + float(ih) * (sh * a.d[ai]);
            } else {
              const float sc = d * float(sb[kq_sc(QT) + r]);
              const float mn = dmin * float(sb[kq_mn(QT) + r]);
              acc = acc + float(il + ih) * (sc * a.d[ai]);
              acc = acc - mn * a.s[ai];
            }
          }
        }
      }
      y[m * w.rows + r0 + r] = bias ? acc + bias[r0 + r] : acc;
    }
  }
}

constexpr int kMaxTile = 1;

#endif

template <int QT>
void gemm_q(const QWeights& w, const ActQ& a, int64_t m, float* y, const float* bias, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
#if defined(K_AVX512) || defined(K_AVX2)
    // many activation rows: the group's tiles take long enough to fetch the next group's
    // weights meanwhile, which would otherwise stall the first tile on memory
    if (m > kMaxTile && g + 1 < w.ngroups) {
      const char* next = reinterpret_cast<const char*>(w.data + (g + 1) * w.group_bytes);
      for (int64_t off = 0; off < w.group_bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
    }
#endif
    int64_t m0 = 0;
    for (; m0 + kMaxTile <= m; m0 += kMaxTile) run_tile<QT, kMaxTile>(w, a, g, m0, y, bias);
    switch (m - m0) {
#if defined(K_AVX512)
      case 7: run_tile<QT, 7>(w, a, g, m0, y, bias); break;
      case 6: run_tile<QT, 6>(w, a, g, m0, y, bias); break;
      case 5: run_tile<QT, 5>(w, a, g, m0, y, bias); break;
      case 4: run_tile<QT, 4>(w, a, g, m0, y, bias); break;
      case 3: run_tile<QT, 3>(w, a, g, m0, y, bias); break;
      case 2: run_tile<QT, 2>(w, a, g, m0, y, bias); break;
#endif
      case 1: run_tile<QT, 1>(w, a, g, m0, y, bias); break;
      default: break;
    }
  }
}

// ---------------------------------------------------------------------------
// float weights (F32 / F16 / BF16, row-major): y[m, r] = dot(x[m], w[r]); per (m, r) two
// accumulators over alternating chunks, then a fixed reduction.

#if defined(K_AVX512)
template <int QT>
inline __m512 loadw16(const uint8_t* row, int64_t k) {
  if constexpr (QT == kF32) return _mm512_loadu_ps((const float*)row + k);
  if constexpr (QT == kF16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(row + 2 * k)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + 2 * k))), 16));
}
template <int QT>
inline __m512 loadw16_mask(const uint8_t* row, int64_t k, __mmask16 msk) {
  if constexpr (QT == kF32) return _mm512_maskz_loadu_ps(msk, (const float*)row + k);
  const __m256i h = _mm256_maskz_loadu_epi16(msk, row + 2 * k);
  if constexpr (QT == kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int QT, int T>
void float_rows(const QWeights& w, const float* x, int64_t m0, float* y, const float* bias, int64_t r) {
  const uint8_t* row = w.data + r * w.unit_bytes;
  const int64_t n = w.cols;
  __m512 a0[T], a1[T];
  for (int t = 0; t < T; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m512 w0 = loadw16<QT>(row, k), w1 = loadw16<QT>(row, k + 16);
    for (int t = 0; t < T; ++t) {
      const float* xr = x + (m0 + t) * n;
      a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr + k), a0[t]);
      a1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + k + 16), a1[t]);
    }
  }
  if (k + 16 <= n) {
    const __m512 w0 = loadw16<QT>(row, k);
    for (int t = 0; t < T; ++t) a0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + (m0 + t) * n + k), a0[t]);
    k += 16;
  }
  if (k < n) {
    const __mmask16 msk = __mmask16((1u << (n - k)) - 1);
    const __m512 w1 = loadw16_mask<QT>(row, k, msk);
    for (int t = 0; t < T; ++t)
      a1[t] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(msk, x + (m0 + t) * n + k), a1[t]);
  }
  for (int t = 0; t < T; ++t) {
    const float v = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
    y[(m0 + t) * w.rows + r] = bias ? v + bias[r] : v;
  }
}
constexpr int kFloatTile = 4;
#elif defined(K_AVX2)
template <int QT>
inline __m256 loadw8(const uint8_t* row, int64_t k) {
  if constexpr (QT == kF32) return _mm256_loadu_ps((const float*)row + k);
  const __m128i h = _mm_loadu_si128((const __m128i*)(row + 2 * k));
  if constexpr (QT == kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
template <int QT, int T>
void float_rows(const QWeights& w, const float* x, int64_t m0, float* y, const float* bias, int64_t r) {
  const uint8_t* row = w.data + r * w.unit_bytes;
  const int64_t n = w.cols;
  __m256 a0[T], a1[T];
  for (int t = 0; t < T; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256 w0 = loadw8<QT>(row, k), w1 = loadw8<QT>(row, k + 8);
    for (int t = 0; t < T; ++t) {
      const float* xr = x + (m0 + t) * n;
      a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr + k), a0[t]);
      a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + k + 8), a1[t]);
    }
  }
  if (k + 8 <= n) {
    const __m256 w0 = loadw8<QT>(row, k);
    for (int t = 0; t < T; ++t) a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + (m0 + t) * n + k), a0[t]);
    k += 8;
  }
  for (int t = 0; t < T; ++t) {
    float v = hsum8(_mm256_add_ps(a0[t], a1[t]));
    const float* xr = x + (m0 + t) * n;
    for (int64_t kk = k; kk < n; ++kk) v = v + float_weight(w, row, kk) * xr[kk];
    y[(m0 + t) * w.rows + r] = bias ? v + bias[r] : v;
  }
}
constexpr int kFloatTile = 4;
#else
template <int QT, int T>
void float_rows(const QWeights& w, const float* x, int64_t m0, float* y, const float* bias, int64_t r) {
  const uint8_t* row = w.data + r * w.unit_bytes;
  const int64_t n = w.cols;
  for (int t = 0; t < T; ++t) {
    const float* xr = x + (m0 + t) * n;
    float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
      for (int i = 0; i < 8; ++i) a[i] = a[i] + float_weight(w, row, k + i) * xr[k + i];
    float v = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (; k < n; ++k) v = v + float_weight(w, row, k) * xr[k];
    y[(m0 + t) * w.rows + r] = bias ? v + bias[r] : v;
  }
}
constexpr int kFloatTile = 1;
#endif

template <int QT>
void gemm_f(const QWeights& w, const float* x, int64_t m, float* y, const float* bias, int64_t g0, int64_t g1) {
  const int64_t r1 = imin(w.rows, g1 * kGroupRows);
  for (int64_t r = g0 * kGroupRows; r < r1; ++r) {
    int64_t m0 = 0;
    for (; m0 + kFloatTile <= m; m0 += kFloatTile) float_rows<QT, kFloatTile>(w, x, m0, y, bias, r);
    for (; m0 < m; ++m0) float_rows<QT, 1>(w, x, m0, y, bias, r);
  }
}

void gemm(const QWeights& w, const ActQ& a, const float* x, int64_t m, float* y, const float* bias,
          int64_t g0, int64_t g1) {
  switch (w.qtype) {
    case kQ4_0: gemm_q<kQ4_0>(w, a, m, y, bias, g0, g1); break;
    case kQ4_1: gemm_q<kQ4_1>(w, a, m, y, bias, g0, g1); break;
    case kQ8_0: gemm_q<kQ8_0>(w, a, m, y, bias, g0, g1); break;
    case kQ4_K: gemm_q<kQ4_K>(w, a, m, y, bias, g0, g1); break;
    case kQ5_K: gemm_q<kQ5_K>(w, a, m, y, bias, g0, g1); break;
    case kQ6_K: gemm_q<kQ6_K>(w, a, m, y, bias, g0, g1); break;
    case kF32: gemm_f<kF32>(w, x, m, y, bias, g0, g1); break;
    case kF16: gemm_f<kF16>(w, x, m, y, bias, g0, g1); break;
    case kBF16: gemm_f<kBF16>(w, x, m, y, bias, g0, g1); break;
    default: break;
  }
}

// ===========================================================================
// Elementwise / row ops

#if defined(K_AVX512)
// exp for x in [-88.37, 88.37] (clamped), cephes polynomial, ~1 ulp
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#elif defined(K_AVX2)
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// sum of squares with a fixed order per row
inline float sum_sq(const float* x, int64_t n) {
#if defined(K_AVX512)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m512 v0 = _mm512_loadu_ps(x + k), v1 = _mm512_loadu_ps(x + k + 16);
    a0 = _mm512_fmadd_ps(v0, v0, a0);
    a1 = _mm512_fmadd_ps(v1, v1, a1);
  }
  for (; k < n; k += 16) {
    const __mmask16 msk = n - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - k)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(msk, x + k);
    a0 = _mm512_fmadd_ps(v, v, a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(K_AVX2)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + k), v1 = _mm256_loadu_ps(x + k + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  float s = hsum8(_mm256_add_ps(a0, a1));
  for (; k < n; ++k) s = s + x[k] * x[k];
  return s;
#else
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int i = 0; i < 8; ++i) a[i] = a[i] + x[k + i] * x[k + i];
  float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  for (; k < n; ++k) s = s + x[k] * x[k];
  return s;
#endif
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(sum_sq(x, n) / float(n) + eps);
  for (int64_t k = 0; k < n; ++k) out[k] = w[k] * (x[k] * r);  // torch: weight * (h * rsqrt)
}

void rms_norm(const float* x, const float* w, float* out, int64_t r0, int64_t r1, int64_t n, float eps) {
  for (int64_t r = r0; r < r1; ++r) norm_row(x + r * n, w, out + r * n, n, eps);
}

void add_rms_norm(float* res, const float* x, const float* w, float* out, int64_t r0, int64_t r1, int64_t n,
                  float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    float* rr = res + r * n;
    const float* xr = x + r * n;
    for (int64_t k = 0; k < n; ++k) rr[k] = rr[k] + xr[k];
    norm_row(rr, w, out + r * n, n, eps);
  }
}

void rope(float* x, int64_t r0, int64_t r1, int64_t n_heads, int64_t head_dim, int64_t row_stride,
          const int64_t* pos, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t i = r0; i < r1; ++i) {
    const float* c = cos + pos[i] * head_dim;
    const float* s = sin + pos[i] * head_dim;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* xh = x + i * row_stride + h * head_dim;
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = xh[j], x2 = xh[j + half];
        xh[j] = x1 * c[j] - x2 * s[j];
        xh[j + half] = x2 * c[j + half] + x1 * s[j + half];
      }
    }
  }
}

void swiglu(const float* gu, float* out, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * n;
    const float* u = g + n;
    float* o = out + r * n;
    int64_t k = 0;
#if defined(K_AVX512)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; k + 16 <= n; k += 16) {
      const __m512 gv = _mm512_loadu_ps(g + k);
      const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_storeu_ps(o + k, _mm512_mul_ps(sv, _mm512_loadu_ps(u + k)));
    }
#elif defined(K_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; k + 8 <= n; k += 8) {
      const __m256 gv = _mm256_loadu_ps(g + k);
      const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      _mm256_storeu_ps(o + k, _mm256_mul_ps(sv, _mm256_loadu_ps(u + k)));
    }
#endif
    for (; k < n; ++k) o[k] = (g[k] / (1.0f + std::exp(-g[k]))) * u[k];
  }
}

// p[i] = exp(x[i] - mx), returns the sum (fixed order)
inline float exp_sub_sum(const float* x, float* p, int64_t n, float mx) {
  int64_t k = 0;
  float sum = 0.0f;
#if defined(K_AVX512)
  __m512 acc = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(mx);
  for (; k + 16 <= n; k += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + k), vm));
    _mm512_storeu_ps(p + k, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(K_AVX2)
  __m256 acc = _mm256_setzero_ps();
  const __m256 vm = _mm256_set1_ps(mx);
  for (; k + 8 <= n; k += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + k), vm));
    _mm256_storeu_ps(p + k, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; k < n; ++k) {
    p[k] = std::exp(x[k] - mx);
    sum = sum + p[k];
  }
  return sum;
}

inline float row_max(const float* x, int64_t n) {
  float mx = -INFINITY;
  for (int64_t k = 0; k < n; ++k) mx = x[k] > mx ? x[k] : mx;
  return mx;
}

void softmax(const float* x, float* out, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    const float mx = row_max(xr, n);
    const float inv = 1.0f / exp_sub_sum(xr, o, n, mx);
    for (int64_t k = 0; k < n; ++k) o[k] = o[k] * inv;
  }
}

// ---------------------------------------------------------------------------
// attention

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(K_AVX512)
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
  if (k < n) {
    const __mmask16 msk = __mmask16((1u << (n - k)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(msk, a + k), _mm512_maskz_loadu_ps(msk, b + k), acc);
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(K_AVX2)
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
  float s = hsum8(acc);
  for (; k < n; ++k) s = s + a[k] * b[k];
  return s;
#else
  float s = 0.0f;
  for (int64_t k = 0; k < n; ++k) s = s + a[k] * b[k];
  return s;
#endif
}

// y += a * x
inline void axpy(float* y, float a, const float* x, int64_t n) {
  int64_t k = 0;
#if defined(K_AVX512)
  const __m512 va = _mm512_set1_ps(a);
  for (; k + 16 <= n; k += 16)
    _mm512_storeu_ps(y + k, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + k), _mm512_loadu_ps(y + k)));
#elif defined(K_AVX2)
  const __m256 va = _mm256_set1_ps(a);
  for (; k + 8 <= n; k += 8)
    _mm256_storeu_ps(y + k, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + k), _mm256_loadu_ps(y + k)));
#endif
  for (; k < n; ++k) y[k] = y[k] + a * x[k];
}

// Attention, partial pass. A task is one partition (part_tokens consecutive positions) of
// one sequence, for all heads: it reads that stretch of the cache once, front to back. It
// leaves per head the unnormalized output o = sum_t exp(s_t - max) v_t, the max and the sum;
// attn_combine merges the partitions in order. Partition bounds depend only on the position,
// so a sequence's result never depends on the batch it is in or on the thread count.

// row offsets (in floats, head 0) of positions s0..s0+n-1 of a sequence in the paged cache
constexpr int64_t kMaxPartTokens = 256;
inline void part_rows(const AttnArgs& a, const int32_t* bt, int64_t s0, int64_t n, int64_t* rows) {
  int64_t blk = s0 / a.block_size, off = s0 % a.block_size;
  const int64_t row_floats = a.num_kv_heads * a.head_dim;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = (int64_t(bt[blk]) * a.block_size + off) * row_floats;
    if (++off == a.block_size) {
      off = 0;
      ++blk;
    }
  }
}

inline float* partial_of(const AttnArgs& a, int64_t seq, int64_t head, int64_t part) {
  return a.partial + ((seq * a.num_heads + head) * a.max_parts + part) * (a.head_dim + 2);
}

// softmax statistics of scores[h][0..n) for every head; scores become exp(s - max)
inline void part_softmax(const AttnArgs& a, int64_t seq, int64_t part, float* scores, int64_t n) {
  for (int64_t h = 0; h < a.num_heads; ++h) {
    float* sc = scores + h * a.part_tokens;
    const float mx = row_max(sc, n);
    float* po = partial_of(a, seq, h, part);
    po[a.head_dim] = mx;
    po[a.head_dim + 1] = exp_sub_sum(sc, sc, n, mx);
  }
}

#if defined(K_AVX512)
// 8 vectors -> their 8 horizontal sums, in order. Every input is reduced by the same tree
// ((lane i + lane i+2) within 128 bits, then pairs, then the 128-bit lanes as (0+1)+(2+3)), so
// a value's sum does not depend on its position among the 8.
inline __m256 hsum8x(const __m512 (&v)[8]) {
  __m512 a[4];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // b[i], 128-bit lane L: the lane-L sums of v[4i], v[4i+1], v[4i+2], v[4i+3]
  const __m512 b0 = _mm512_add_ps(_mm512_shuffle_ps(a[0], a[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(a[0], a[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 b1 = _mm512_add_ps(_mm512_shuffle_ps(a[2], a[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(a[2], a[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // c lanes: b0 L0+L1, b0 L2+L3, b1 L0+L1, b1 L2+L3
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(3, 1, 3, 1)));
  // e lane 0: v0..v3, lane 2: v4..v7
  const __m512 e = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps256(_mm512_shuffle_f32x4(e, e, _MM_SHUFFLE(2, 0, 2, 0)));
}

// 16 cache values from element offset `off` of a cache of dtype KD, as float32
template <int KD>
inline __m512 kv_load16(const void* base, int64_t off) {
  if constexpr (KD == kKvF32) return _mm512_loadu_ps(static_cast<const float*>(base) + off);
  if constexpr (KD == kKvI8)  // unscaled: the caller applies the (slot, head) scale
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(static_cast<const int8_t*>(base) + off))));
  const __m256i h = _mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(base) + off));
  if constexpr (KD == kKvF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the weight of a V row in the output: its softmax weight p, times its scale for an int8 cache
template <int KD>
inline float v_weight(const AttnArgs& a, float p, int64_t scale_index) {
  if constexpr (KD == kKvI8) return p * a.v_scale[scale_index];
  return p;
}

// V pass: heads that share a KV head, kVHeads<NV> at a time (their accumulators in registers),
// so each V row is loaded and converted once for all of them. Per head two accumulators
// (even / odd positions of the partition), positions in order.
template <int NV>
constexpr int kVHeads = NV <= 2 ? 6 : NV <= 4 ? 3 : NV <= 6 ? 2 : 1;

template <int NV, int KD, int NB>
void v_heads(const AttnArgs& a, int64_t seq, int64_t part, const int64_t* rows, int64_t n, const float* scores,
             int64_t h0, int64_t kvh) {
  const int64_t P = a.part_tokens;
  const int64_t vc = kvh * 16 * NV;
  __m512 acc[2][NB][NV];
  for (int e = 0; e < 2; ++e)
    for (int b = 0; b < NB; ++b)
      for (int v = 0; v < NV; ++v) acc[e][b][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const int e = int(j & 1);
    const int64_t off = vc + rows[j];
    __m512 r[NV];
    for (int v = 0; v < NV; ++v) r[v] = kv_load16<KD>(a.v_cache, off + 16 * v);
    for (int b = 0; b < NB; ++b) {
      const __m512 pb = _mm512_set1_ps(v_weight<KD>(a, scores[(h0 + b) * P + j], off / (16 * NV)));
      for (int v = 0; v < NV; ++v) acc[e][b][v] = _mm512_fmadd_ps(pb, r[v], acc[e][b][v]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    float* po = partial_of(a, seq, h0 + b, part);
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(po + 16 * v, _mm512_add_ps(acc[0][b][v], acc[1][b][v]));
  }
}

// v_heads for nb (<= NB) heads
template <int NV, int KD, int NB>
inline void v_heads_upto(int64_t nb, const AttnArgs& a, int64_t seq, int64_t part, const int64_t* rows, int64_t n,
                         const float* scores, int64_t h0, int64_t kvh) {
  if constexpr (NB >= 1) {
    if (nb == NB)
      v_heads<NV, KD, NB>(a, seq, part, rows, n, scores, h0, kvh);
    else
      v_heads_upto<NV, KD, NB - 1>(nb, a, seq, part, rows, n, scores, h0, kvh);
  }
}

// head_dim = 16 * NV. Scores: position by position in cache order, each K row read once for
// the heads that share it, dot products reduced 8 positions at a time. Output: v_heads.
template <int NV, int KD>
void attn_part_v(const AttnArgs& a, int64_t seq, int64_t part, float* scores, float* accbuf) {
  constexpr int64_t ES = KD == kKvF32 ? 4 : KD == kKvI8 ? 1 : 2;  // bytes per cache element
  const int64_t G = a.num_heads / a.num_kv_heads;
  const int64_t P = a.part_tokens;
  const int64_t H = a.num_heads;
  const int64_t s0 = part * P, s1 = imin<int64_t>(a.seq_lens[seq], s0 + P), n = s1 - s0;
  const int32_t* bt = a.block_table + seq * a.max_blocks;
  const float* q = a.q + seq * a.q_stride;
  const __m512 scale = _mm512_set1_ps(a.scale);
  int64_t rows[kMaxPartTokens];
  part_rows(a, bt, s0, n, rows);
  const __m256 scale8 = _mm512_castps512_ps256(scale);
  const int64_t row_bytes = a.num_kv_heads * 16 * NV * ES;
  // K pass, position by position in cache order (all kv heads of a position are adjacent)
  float* dbuf = accbuf;  // [H][8][16] partial dot vectors, reduced 8 positions at a time
  for (int64_t c8 = 0; c8 < n; c8 += 8) {
    const int64_t left = n - c8;
    for (int j = 0; j < 8; ++j) {
      if (j >= left) {
        for (int64_t h = 0; h < H; ++h) _mm512_storeu_ps(dbuf + (h * 8 + j) * 16, _mm512_setzero_ps());
        continue;
      }
      const int64_t row = rows[c8 + j];
      // steady software prefetch: the K row 24 positions ahead into L1, this position's V row
      // into L2 for the V pass (measured from DRAM: +10% float32, +40% bfloat16)
      const char* kn = static_cast<const char*>(a.k_cache) + rows[imin<int64_t>(c8 + j + 24, n - 1)] * ES;
      const char* vn = static_cast<const char*>(a.v_cache) + row * ES;
      for (int64_t off = 0; off < row_bytes; off += 64) {
        _mm_prefetch(kn + off, _MM_HINT_T0);
        _mm_prefetch(vn + off, _MM_HINT_T1);
      }
      for (int64_t kvh = 0; kvh < a.num_kv_heads; ++kvh) {
        __m512 k[NV];
        for (int v = 0; v < NV; ++v) k[v] = kv_load16<KD>(a.k_cache, row + kvh * 16 * NV + 16 * v);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kvh * G + g;
          const float* qh = q + h * 16 * NV;
          __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
          for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * v), k[v], acc);
          if constexpr (KD == kKvI8) acc = _mm512_mul_ps(acc, _mm512_set1_ps(a.k_scale[row / (16 * NV) + kvh]));
          _mm512_storeu_ps(dbuf + (h * 8 + j) * 16, acc);
        }
      }
    }
    const __mmask8 msk = left >= 8 ? __mmask8(0xff) : __mmask8((1u << left) - 1);
    for (int64_t h = 0; h < H; ++h) {
      __m512 d[8];
      for (int j = 0; j < 8; ++j) d[j] = _mm512_loadu_ps(dbuf + (h * 8 + j) * 16);
      _mm256_mask_storeu_ps(scores + h * P + c8, msk, _mm256_mul_ps(hsum8x(d), scale8));
    }
  }
  part_softmax(a, seq, part, scores, n);
  for (int64_t kvh = 0; kvh < a.num_kv_heads; ++kvh)
    for (int64_t h0 = kvh * G; h0 < (kvh + 1) * G; h0 += kVHeads<NV>)
      v_heads_upto<NV, KD, kVHeads<NV>>(imin<int64_t>(kVHeads<NV>, (kvh + 1) * G - h0), a, seq, part, rows, n, scores,
                                        h0, kvh);
}
#endif

// n cache values from element offset off as float32 (a view when the cache is float32);
// scales: the cache's int8 scales, one per head_dim values
inline const float* kv_row_f32(const AttnArgs& a, const void* cache, const float* scales, int64_t off, int64_t n,
                               float* tmp) {
  if (a.kv_dtype == kKvF32) return static_cast<const float*>(cache) + off;
  if (a.kv_dtype == kKvI8) {
    const int8_t* q = static_cast<const int8_t*>(cache) + off;
    const float d = scales[off / a.head_dim];
    for (int64_t i = 0; i < n; ++i) tmp[i] = float(q[i]) * d;
    return tmp;
  }
  const uint16_t* h = static_cast<const uint16_t*>(cache) + off;
  if (a.kv_dtype == kKvF16) {
    for (int64_t i = 0; i < n; ++i) tmp[i] = fp16_to_fp32(h[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) tmp[i] = bf16_to_fp32(h[i]);
  }
  return tmp;
}

// any head_dim: dot / axpy helpers, the output accumulated in scratch
void attn_part_generic(const AttnArgs& a, int64_t seq, int64_t part, float* scores, float* acc) {
  float* tmp = acc + a.head_dim;  // one converted cache row
  const int64_t G = a.num_heads / a.num_kv_heads;
  const int64_t hd = a.head_dim;
  const int64_t P = a.part_tokens;
  const int64_t s0 = part * P, s1 = imin<int64_t>(a.seq_lens[seq], s0 + P), n = s1 - s0;
  const int32_t* bt = a.block_table + seq * a.max_blocks;
  const float* q = a.q + seq * a.q_stride;
  int64_t rows[kMaxPartTokens];
  part_rows(a, bt, s0, n, rows);
  for (int64_t t = s0; t < s1; ++t) {
    for (int64_t kvh = 0; kvh < a.num_kv_heads; ++kvh) {
      const float* kr = kv_row_f32(a, a.k_cache, a.k_scale, rows[t - s0] + kvh * hd, hd, tmp);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        scores[h * P + (t - s0)] = dot(q + h * hd, kr, hd) * a.scale;
      }
    }
  }
  part_softmax(a, seq, part, scores, n);
  for (int64_t h = 0; h < a.num_heads; ++h) {
    const int64_t kvh = h / G;
    for (int64_t i = 0; i < hd; ++i) acc[i] = 0.0f;
    for (int64_t t = s0; t < s1; ++t)
      axpy(acc, scores[h * P + (t - s0)], kv_row_f32(a, a.v_cache, a.v_scale, rows[t - s0] + kvh * hd, hd, tmp), hd);
    std::memcpy(partial_of(a, seq, h, part), acc, size_t(hd) * 4);
  }
}

void attn_partial(const AttnArgs& a, int64_t t0, int64_t t1, float* scratch) {
  float* scores = scratch;                             // [num_heads][part_tokens]
  float* acc = scratch + a.num_heads * a.part_tokens;  // [num_heads][2][head_dim]
  // Tasks go kAttnQueryBlock query tokens at a time, partition-major within the block: the
  // tokens of a prefill chunk read the same partitions of the same cache, so a partition is
  // loaded once (into L1 / L2) for the whole block instead of once per token (a 2048-token
  // prompt's cache is larger than L2). The order changes nothing of what a task computes.
  const int64_t block_tasks = kAttnQueryBlock * a.max_parts;
  for (int64_t task = t0; task < t1; ++task) {
    const int64_t first = task / block_tasks * kAttnQueryBlock, r = task % block_tasks;
    const int64_t part = r / kAttnQueryBlock, seq = first + r % kAttnQueryBlock;
    if (seq >= a.num_seqs || part * a.part_tokens >= a.seq_lens[seq]) continue;  // nothing to do
#if defined(K_AVX512)
#define CHURON_ATTN_NV(NV)                                                                   \
  case 16 * NV:                                                                              \
    if (a.kv_dtype == kKvF32) attn_part_v<NV, kKvF32>(a, seq, part, scores, acc);            \
    else if (a.kv_dtype == kKvF16) attn_part_v<NV, kKvF16>(a, seq, part, scores, acc);       \
    else if (a.kv_dtype == kKvI8) attn_part_v<NV, kKvI8>(a, seq, part, scores, acc);         \
    else attn_part_v<NV, kKvBF16>(a, seq, part, scores, acc);                                \
    continue;
    switch (a.head_dim) {
      CHURON_ATTN_NV(2)
      CHURON_ATTN_NV(4)
      CHURON_ATTN_NV(5)
      CHURON_ATTN_NV(6)
      CHURON_ATTN_NV(8)
      CHURON_ATTN_NV(16)
      default: break;
    }
#undef CHURON_ATTN_NV
#endif
    attn_part_generic(a, seq, part, scores, acc);
  }
}

void attn_combine(const AttnArgs& a, int64_t t0, int64_t t1) {
  const int64_t hd = a.head_dim;
  for (int64_t task = t0; task < t1; ++task) {  // task = seq * num_heads + head
    const int64_t seq = task / a.num_heads;
    const int64_t len = a.seq_lens[seq];
    float* out = a.out + task * hd;
    const int64_t nparts = (len + a.part_tokens - 1) / a.part_tokens;
    const float* base = a.partial + task * a.max_parts * (hd + 2);
    if (nparts <= 0) {
      for (int64_t i = 0; i < hd; ++i) out[i] = 0.0f;
      continue;
    }
    if (nparts == 1) {
      const float inv = 1.0f / base[hd + 1];
      for (int64_t i = 0; i < hd; ++i) out[i] = base[i] * inv;
      continue;
    }
    float mx = -INFINITY;
    for (int64_t p = 0; p < nparts; ++p) mx = imax(mx, base[p * (hd + 2) + hd]);
    float total = 0.0f;
    for (int64_t i = 0; i < hd; ++i) out[i] = 0.0f;
    for (int64_t p = 0; p < nparts; ++p) {
      const float* po = base + p * (hd + 2);
      const float f = std::exp(po[hd] - mx);
      total = total + f * po[hd + 1];
      axpy(out, f, po, hd);
    }
    const float inv = 1.0f / total;
    for (int64_t i = 0; i < hd; ++i) out[i] = out[i] * inv;
  }
}

// dst[i] = src[i] as float16 (bf16 = false) or bfloat16, bit for bit as fp32_to_fp16 / fp32_to_bf16
void to_half(const float* src, uint16_t* dst, int64_t n, bool bf16) {
  int64_t i = 0;
#if defined(K_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m256i h;
    if (bf16) {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
      h = _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i sign = _mm256_and_si256(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)),
                                            _mm256_set1_epi16(int16_t(0x8000)));
      h = _mm256_mask_mov_epi16(h, nan, _mm256_or_si256(sign, _mm256_set1_epi16(0x7e00)));
    }
    _mm256_storeu_si256((__m256i*)(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = bf16 ? fp32_to_bf16(src[i]) : fp32_to_fp16(src[i]);
}

uint64_t read_bytes(const uint8_t* p, int64_t n) {
#if defined(K_AVX512)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 256 <= n; k += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + k));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + k + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + k + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + k + 192));
  }
  a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  uint64_t h = uint64_t(_mm512_reduce_add_epi64(a0));
#elif defined(K_AVX2)
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 128 <= n; k += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i*)(p + k)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i*)(p + k + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i*)(p + k + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i*)(p + k + 96)));
  }
  a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
  alignas(32) uint64_t t[4];
  _mm256_store_si256((__m256i*)t, a0);
  uint64_t h = t[0] ^ t[1] ^ t[2] ^ t[3];
#else
  uint64_t h = 0;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) h ^= load_u64(p + k);
#endif
  for (; k < n; ++k) h += p[k];
  return h;
}

}  // namespace

const KernelTable* table() {
  static const KernelTable t = {
      CHURON_STR(CHURON_ISA), quantize_act, gemm, dequant_rows, dequant_rows_bf16,
      rms_norm, add_rms_norm, rope, swiglu, softmax, attn_partial, attn_combine, read_bytes, to_half,
  };
  return &t;
}

}  // namespace CHURON_ISA
}  // namespace churon
