// churon CPU kernels, one ISA per compilation.
//
// setup.py compiles this file several times: -DCHURON_ISA=scalar with baseline flags,
// -DCHURON_ISA=avx2 with -mavx2 -mfma -mf16c, -DCHURON_ISA=avx512 with the AVX-512
// F/BW/VL/DQ/VNNI flags. Each copy defines churon::<isa>::table(); isa.cpp picks one at run
// time. Code paths below are chosen by the compiler's predefined ISA macros; loops whose shape
// is an ISA's own come from one file per ISA: the quantized matmul tiles (matmul_<isa>.inc)
// and the AVX-512 attention kernel (attention_avx512.inc). What is not specialised is plain
// C++ that each copy compiles (and auto-vectorises) for its ISA.
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
// Quantized matmul: run_tile<QT, T>(w, a, g, m0, y, bias) computes the 16 rows of group g for
// activation rows m0 .. m0 + T - 1, T <= kMaxTile; the tiles are each ISA's own.

#if defined(K_AVX512)
#include "matmul_avx512.inc"
#elif defined(K_AVX2)
#include "matmul_avx2.inc"
#else
#include "matmul_scalar.inc"
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
#include "attention_avx512.inc"
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
    if (attn_part_avx512(a, seq, part, scores, acc)) continue;
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
