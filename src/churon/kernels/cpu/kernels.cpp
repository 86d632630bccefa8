// churon CPU kernels, one ISA per compilation.
//
// setup.py compiles this file several times: -DCHURON_ISA=scalar with baseline flags,
// -DCHURON_ISA=avx2 with -mavx2 -mfma -mf16c, -DCHURON_ISA=avx512 with the AVX-512
// F/BW/VL/DQ/VNNI flags. Each copy defines churon::<isa>::table(); isa.cpp picks one at run
// time. A vector loop is written once against simd.h, which maps it onto the ISA of this copy
// (K_SIMD: AVX-512 or AVX2); `#else` is the scalar copy's loop. Loops whose shape is an ISA's
// own come from one file per ISA: the quantized matmul tiles (matmul_<isa>.inc) and the
// AVX-512 attention kernel (attention_avx512.inc); LoRA's kernels (lora.inc) are written once
// against simd.h, in a file of their own. What is not specialised is plain C++ that
// each copy compiles (and auto-vectorises) for its ISA.
//
// Everything lives in an anonymous namespace (internal linkage) and uses no out-of-line
// library templates, so no symbol compiled with AVX-512 can be shared with a baseline TU.
//
// Numerics: all files are compiled with -ffp-contract=off, so a*b+c is two roundings unless
// an FMA intrinsic is written. Every kernel computes a given output row with the same
// sequence of operations whatever the row range, the thread, or the number of rows M it is
// batched with (the batch-invariance requirement).

#include <cfloat>
#include <cmath>
#include <type_traits>

#include "common.h"
#include "isa.h"
#include "simd.h"

#if defined(K_AMX)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
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

// Q5_0 / Q5_K 5th bit of row r, column c (0..31) from a unit's / sub-block's qh masks
inline int q5_bit(const uint8_t* qh, int r, int c) {
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
    case kQ5_0: {
      const float d = fp16_to_fp32(load_u16(p + 320 + 2 * r));
      for (int c = 0; c < 32; ++c) out[c] = float((nib(p, r, c) | q5_bit(p + kQ5Qh, r, c) << 4) - 16) * d;
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
          if (qt == kQ5_K) q |= q5_bit(sb + kQ5Qh, r, c) << 4;
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

#if defined(K_AVX512)
// lane j = op over the 16 lanes of v[j]: a tree of pairs within 128 bits (like hsum8x), then across the
// four 128-bit lanes; op is exact here (max, integer add), so its order does not show in the result
template <class Op>
inline __m512 reduce16x(const __m512 (&v)[16], Op op) {
  __m512 u[4];
  for (int g = 0; g < 4; ++g) {
    __m512 t[2];
    for (int h = 0; h < 2; ++h) {
      const __m512 a = v[4 * g + 2 * h], b = v[4 * g + 2 * h + 1];
      // 128-bit lane k: a's lanes 0+2, b's 0+2, a's 1+3, b's 1+3 of that 128 bits
      t[h] = op(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    // 128-bit lane k of u[g]: the lane-k reductions of v[4g .. 4g + 3]
    u[g] = op(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // then across the 128-bit lanes: halves (0 with 2, 1 with 3), then the pairs, v[4g + i] ending in lane 4g + i
  const __m512 w01 = op(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                        _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w23 = op(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                        _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return op(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 consecutive blocks of one row (x, q at the first; i: its index in d / s / sum32): the per-block code's
// values bit for bit (the same division, rounding and saturation; max and integer sums are exact in any
// order), with the reductions of 16 blocks done together rather than one horizontal reduction each
inline void quantize_16_blocks(const float* x, int8_t* q, int64_t i, const ActQ& a) {
  __m512 am[16];
  for (int j = 0; j < 16; ++j)
    am[j] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + 32 * j)),
                          _mm512_abs_ps(_mm512_loadu_ps(x + 32 * j + 16)));
  const __m512 amax = reduce16x(am, [](__m512 p, __m512 r) { return _mm512_max_ps(p, r); });
  const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
  const __m512 id =
      _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.0f), d);
  alignas(64) float ids[16];
  _mm512_store_ps(ids, id);
  __m512 h0[16], h1[16];  // the int32 codes of columns 0..15 and 16..31, as float bits for the shuffles
  for (int j = 0; j < 16; ++j) {
    const __m512 vid = _mm512_set1_ps(ids[j]);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * j), vid));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * j + 16), vid));
    _mm_storeu_si128((__m128i*)(q + 32 * j), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(q + 32 * j + 16), _mm512_cvtsepi32_epi8(q1));
    h0[j] = _mm512_castsi512_ps(q0), h1[j] = _mm512_castsi512_ps(q1);
  }
  const auto add = [](__m512 p, __m512 r) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_castps_si512(r)));
  };
  const __m512i s0 = _mm512_castps_si512(reduce16x(h0, add)), s1 = _mm512_castps_si512(reduce16x(h1, add));
  const __m512i s = _mm512_add_epi32(s0, s1);
  _mm512_storeu_ps(a.d + i, d);
  _mm512_storeu_si512(a.sum32 + i, s);
  // sum16 interleaves them: s0 of block 0, s1 of block 0, s0 of block 1, ...
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_si512(a.sum16 + 2 * i, _mm512_permutex2var_epi32(s0, lo, s1));
  _mm512_storeu_si512(a.sum16 + 2 * i + 16, _mm512_permutex2var_epi32(s0, hi, s1));
  _mm512_storeu_ps(a.s + i, _mm512_mul_ps(d, _mm512_cvtepi32_ps(s)));
}
#endif

void quantize_act(const float* x, int64_t m0, int64_t m1, const ActQ& a) {
  for (int64_t m = m0; m < m1; ++m) {
    int64_t b0 = 0;
#if defined(K_AVX512)
    for (; b0 + 16 <= a.nb; b0 += 16)
      quantize_16_blocks(x + m * a.cols + b0 * 32, a.q + m * a.cols + b0 * 32, m * a.nb + b0, a);
#endif
    for (int64_t b = b0; b < a.nb; ++b) {
      const float* xb = x + m * a.cols + b * 32;
      int8_t* qb = a.q + m * a.cols + b * 32;
#if defined(K_SIMD)
      using namespace simd;
      constexpr int N = kActBlock / kW;  // vectors per block
      V v[N];
      v[0] = loadu(xb);
      V am = abs(v[0]);
      for (int i = 1; i < N; ++i) {
        v[i] = loadu(xb + kW * i);
        am = max(am, abs(v[i]));
      }
      const float amax = reduce_max(am);
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      const V vid = set1(id);
      VI q[N];
      for (int i = 0; i < N; ++i) q[i] = cvt_i32(mul(v[i], vid));
      store_i8(qb, q);
      VI h0 = q[0], h1 = q[N / 2];  // columns 0..15, 16..31
      for (int i = 1; i < N / 2; ++i) {
        h0 = add_i32(h0, q[i]);
        h1 = add_i32(h1, q[N / 2 + i]);
      }
      const int32_t s0 = reduce_add_i32(h0), s1 = reduce_add_i32(h1);
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
// Quantized matmul: run_tile<QT, T>(w, a, g, m0, y, bias, ra) computes the 16 rows of group g for
// activation rows m0 .. m0 + T - 1, T <= kMaxTile; the tiles are each ISA's own.

// One thread's software prefetch into L2, kReadAheadBytes ahead of its sequential read of a matrix's weights, a
// few lines each time the read moves on (upto, from the tiles' loops). On the AMX Xeon this was measured on, the
// hardware prefetchers alone, or a burst of a whole group's lines 4 groups ahead, fed a decode step's matmuls at
// 17-23 GB/s; this at 30-37 GB/s (Gemma 3's coarse logits copy, 136 MB: 5.9 -> 3.7 ms; 4 KiB ahead 4.2 ms,
// 16 KiB 4.0, 32 KiB 4.1). A burst of ~130 prefetches seems to stall on the core's few fill buffers.
constexpr int64_t kReadAheadBytes = 8192;
struct ReadAhead {
  const uint8_t* next;  // the first byte not yet asked for
  const uint8_t* end;   // the weights' end: nothing past it is asked for
  ReadAhead(const uint8_t* from, const uint8_t* end_)
      : next(end_ - from > kReadAheadBytes ? from + kReadAheadBytes : end_), end(end_) {}
  // every line before kReadAheadBytes past p, the end of what the caller reads now
  void upto(const uint8_t* p) {
    const uint8_t* want = end - p > kReadAheadBytes ? p + kReadAheadBytes : end;
    for (; next < want; next += 64) __builtin_prefetch(next, 0, 2);  // prefetcht1: into L2
  }
};

#if defined(K_AMX)
#include "matmul_avx512.inc"
#include "matmul_amx.inc"
#if defined(K_AMX_BF16)
#include "matmul_amx_bf16.inc"
#endif
#elif defined(K_AVX512)
#include "matmul_avx512.inc"
#elif defined(K_AVX2)
#include "matmul_avx2.inc"
#else
#include "matmul_scalar.inc"
#endif

// run_tile<QT, rest> for rest in 1 .. T (nothing for 0)
template <int QT, int T>
inline void run_tile_upto(int64_t rest, const QWeights& w, const ActQ& a, int64_t g, int64_t m0, float* y,
                          const float* bias, ReadAhead* ra) {
  if constexpr (T >= 1) {
    if (rest == T)
      run_tile<QT, T>(w, a, g, m0, y, bias, ra);
    else
      run_tile_upto<QT, T - 1>(rest, w, a, g, m0, y, bias, ra);
  }
}

template <int QT>
void gemm_q(const QWeights& w, const ActQ& a, int64_t m, float* y, const float* bias, int64_t g0, int64_t g1) {
  int64_t first = 0;  // rows [0, first) are done
#if defined(K_AMX)
  // whole tiles of 16 rows on AMX (where this thread may use tiles), the rest on VNNI: a row's
  // result is the same either way. From 32 rows: at 16 a call's one tile does not repay unpacking the
  // weights (cold weights, 2 threads: Q6_K 0.91x, Q4_1 192x576 0.88x VNNI's time; Q4_0 1.15x).
  if (m >= kAmxMinRows && gemm_amx<QT>(w, a, m / 16 * 16, y, bias, g0, g1)) first = m / 16 * 16;
  if (first == m) return;
#endif
  // Intel (isa.h): the weights read ahead, whatever m (SmolLM2's decode, amx copy: 274 -> 345 tok/s; Gemma 3's
  // 82-89 -> 101-112). A thread's claims are contiguous (threadpool.h), so each goes on from where the last stopped.
  ReadAhead ahead(w.data + g0 * w.group_bytes, w.data + w.ngroups * w.group_bytes);
  ReadAhead* ra = prefetch_weights_ahead() ? &ahead : nullptr;
  for (int64_t g = g0; g < g1; ++g) {
#if defined(K_SIMD)
    if (!ra && m - first > kMaxTile && g + 1 < w.ngroups) {
      // many activation rows: the group's tiles take long enough to fetch the next group's weights
      // meanwhile, which would otherwise stall the first tile on memory (for a few rows, on the AMD EPYC
      // Zen 4 this was measured on, a software prefetch here was slower)
      const uint8_t* next = w.data + (g + 1) * w.group_bytes;
      for (int64_t off = 0; off < w.group_bytes; off += 64) simd::prefetch_l2(next + off);
    }
#endif
    int64_t m0 = first;
    ReadAhead* r = ra;  // the group's first tile reads it from memory, the others from L1 / L2
    for (; m0 + kMaxTile <= m; m0 += kMaxTile, r = nullptr) run_tile<QT, kMaxTile>(w, a, g, m0, y, bias, r);
    run_tile_upto<QT, kMaxTile - 1>(m - m0, w, a, g, m0, y, bias, r);
  }
}

// ---------------------------------------------------------------------------
// float weights (F32 / F16 / BF16, row-major): y[m, r] = dot(x[m], w[r]); per (m, r) two
// accumulators over alternating chunks, then a fixed reduction.

#if defined(K_SIMD)
template <int QT>
inline simd::V load_w(const uint8_t* row, int64_t k) {
  if constexpr (QT == kF32) return simd::loadu((const float*)row + k);
  if constexpr (QT == kF16) return simd::load_f16(row + 2 * k);
  return simd::load_bf16(row + 2 * k);
}
#if defined(K_MASK)
template <int QT>
inline simd::V maskz_load_w(simd::Mask msk, const uint8_t* row, int64_t k) {
  if constexpr (QT == kF32) return simd::maskz_loadu(msk, (const float*)row + k);
  if constexpr (QT == kF16) return simd::maskz_load_f16(msk, row + 2 * k);
  return simd::maskz_load_bf16(msk, row + 2 * k);
}
#endif

template <int QT, int T>
void float_rows(const QWeights& w, const float* x, int64_t m0, float* y, const float* bias, int64_t r) {
  using namespace simd;
  const uint8_t* row = w.data + r * w.unit_bytes;
  const int64_t n = w.cols;
  V a0[T], a1[T];
  for (int t = 0; t < T; ++t) a0[t] = a1[t] = zero();
  int64_t k = 0;
  for (; k + 2 * kW <= n; k += 2 * kW) {
    const V w0 = load_w<QT>(row, k), w1 = load_w<QT>(row, k + kW);
    for (int t = 0; t < T; ++t) {
      const float* xr = x + (m0 + t) * n;
      a0[t] = fmadd(w0, loadu(xr + k), a0[t]);
      a1[t] = fmadd(w1, loadu(xr + k + kW), a1[t]);
    }
  }
  if (k + kW <= n) {
    const V w0 = load_w<QT>(row, k);
    for (int t = 0; t < T; ++t) a0[t] = fmadd(w0, loadu(x + (m0 + t) * n + k), a0[t]);
    k += kW;
  }
#if defined(K_MASK)
  if (k < n) {
    const Mask msk = tail_mask(n - k);
    const V w1 = maskz_load_w<QT>(msk, row, k);
    for (int t = 0; t < T; ++t) a1[t] = fmadd(w1, maskz_loadu(msk, x + (m0 + t) * n + k), a1[t]);
  }
#endif
  for (int t = 0; t < T; ++t) {
    float v = reduce_add(add(a0[t], a1[t]));
#if !defined(K_MASK)
    const float* xr = x + (m0 + t) * n;
    for (int64_t kk = k; kk < n; ++kk) v = v + float_weight(w, row, kk) * xr[kk];
#endif
    y[(m0 + t) * w.ldy + r] = bias ? v + bias[r] : v;
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
    y[(m0 + t) * w.ldy + r] = bias ? v + bias[r] : v;
  }
}
constexpr int kFloatTile = 1;
#endif

// Activation rows a block of about kFloatBlockBytes at a time, every weight row of the range over each
// block: the block stays in L1 / L2 (x streamed once per weight row made a 2048-token MiniLM layer 3x
// slower than torch). A tile of kFloatTile rows and a single row compute each output the same way, so
// where the blocks and tiles fall changes no result.
constexpr int64_t kFloatBlockBytes = 32 << 10;

template <int QT>
void gemm_f(const QWeights& w, const float* x, int64_t m, float* y, const float* bias, int64_t g0, int64_t g1) {
  const int64_t r1 = imin(w.rows, g1 * kGroupRows);
  const int64_t block = imax<int64_t>(kFloatTile, kFloatBlockBytes / (4 * w.cols) / kFloatTile * kFloatTile);
  for (int64_t b0 = 0; b0 < m; b0 += block) {
    const int64_t b1 = imin(m, b0 + block);
    // as gemm_q; every block of activation rows reads the weight rows again
    ReadAhead ahead(w.data + g0 * kGroupRows * w.unit_bytes, w.data + w.rows * w.unit_bytes);
    ReadAhead* ra = prefetch_weights_ahead() ? &ahead : nullptr;
    for (int64_t r = g0 * kGroupRows; r < r1; ++r) {
      if (ra) ra->upto(w.data + (r + 1) * w.unit_bytes);
      int64_t m0 = b0;
      for (; m0 + kFloatTile <= b1; m0 += kFloatTile) float_rows<QT, kFloatTile>(w, x, m0, y, bias, r);
      for (; m0 < b1; ++m0) float_rows<QT, 1>(w, x, m0, y, bias, r);
    }
  }
}

void gemm(const QWeights& w, const ActQ& a, const float* x, int64_t m, float* y, const float* bias,
          int64_t g0, int64_t g1) {
  switch (w.qtype) {
    case kQ4_0: gemm_q<kQ4_0>(w, a, m, y, bias, g0, g1); break;
    case kQ4_1: gemm_q<kQ4_1>(w, a, m, y, bias, g0, g1); break;
    case kQ5_0: gemm_q<kQ5_0>(w, a, m, y, bias, g0, g1); break;
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

// sum of (x - c)^2 with a fixed order per row (c = 0: RMSNorm, the mean: LayerNorm's variance)
inline float sum_sq(const float* x, int64_t n, float c) {
#if defined(K_SIMD)
  using namespace simd;
  const V vc = set1(c);
  V a0 = zero(), a1 = a0;
  int64_t k = 0;
  for (; k + 2 * kW <= n; k += 2 * kW) {
    const V v0 = sub(loadu(x + k), vc), v1 = sub(loadu(x + k + kW), vc);
    a0 = fmadd(v0, v0, a0);
    a1 = fmadd(v1, v1, a1);
  }
#if defined(K_MASK)
  for (; k < n; k += kW) {
    const Mask msk = tail_mask(n - k);
    const V d = maskz_sub(msk, maskz_loadu(msk, x + k), vc);
    a0 = fmadd(d, d, a0);
  }
  return reduce_add(add(a0, a1));
#else
  float s = reduce_add(add(a0, a1));
  for (; k < n; ++k) s = s + (x[k] - c) * (x[k] - c);
  return s;
#endif
#else
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int i = 0; i < 8; ++i) a[i] = a[i] + (x[k + i] - c) * (x[k + i] - c);
  float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  for (; k < n; ++k) s = s + (x[k] - c) * (x[k] - c);
  return s;
#endif
}

// sum of x with a fixed order per row
inline float row_sum(const float* x, int64_t n) {
#if defined(K_SIMD)
  using namespace simd;
  V a0 = zero(), a1 = a0;
  int64_t k = 0;
  for (; k + 2 * kW <= n; k += 2 * kW) {
    a0 = add(a0, loadu(x + k));
    a1 = add(a1, loadu(x + k + kW));
  }
#if defined(K_MASK)
  for (; k < n; k += kW) a0 = add(a0, maskz_loadu(tail_mask(n - k), x + k));
  return reduce_add(add(a0, a1));
#else
  float s = reduce_add(add(a0, a1));
  for (; k < n; ++k) s = s + x[k];
  return s;
#endif
#else
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int i = 0; i < 8; ++i) a[i] = a[i] + x[k + i];
  float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  for (; k < n; ++k) s = s + x[k];
  return s;
#endif
}

inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float r = 1.0f / std::sqrt(sum_sq(x, n, 0.0f) / float(n) + eps);
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

// LayerNorm with the two-pass variance (the mean first, then the squares about it: no cancellation)
void layer_norm(const float* x, const float* res, const float* w, const float* b, float* out, int64_t r0, int64_t r1,
                int64_t n, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    if (res) {
      const float* rr = res + r * n;
      for (int64_t k = 0; k < n; ++k) o[k] = rr[k] + xr[k];
      xr = o;
    }
    const float mean = row_sum(xr, n) / float(n);
    const float rstd = 1.0f / std::sqrt(sum_sq(xr, n, mean) / float(n) + eps);
    for (int64_t k = 0; k < n; ++k) o[k] = (xr[k] - mean) * rstd * w[k] + b[k];
  }
}

#if defined(K_SIMD)
// x / (1 + exp(-2u)) = x * 0.5 * (1 + tanh(u)), u = sqrt(2 / pi) * (x + 0.044715 x^3): no cancellation
// for x < 0, and exp's clamp keeps it finite (-> x or -> 0) where tanh saturates
inline simd::V gelu_tanh_v(simd::V x) {
  using namespace simd;
  const V m2u = mul(x, fmadd(mul(x, x), set1(-0.0713548162726f), set1(-1.5957691216057f)));
  return div(x, add(set1(1.0f), exp(m2u)));
}

// x * 0.5 * (1 + erf(x / sqrt 2)), as x * 0.5 * erfc(-x / sqrt 2)
inline simd::V gelu_erf_v(simd::V x) {
  using namespace simd;
  return mul(mul(x, set1(0.5f)), erfc(mul(x, set1(-0.707106781186547524f))));
}

// out[i] = f(x[i]) for n values (out may be x), every one through the same vector function (a short
// tail padded to a whole vector), so its result depends on its value alone, not on where it sits
template <class F>
inline void map_v(const float* x, float* out, int64_t n, F f) {
  using namespace simd;
  int64_t i = 0;
  for (; i + kW <= n; i += kW) storeu(out + i, f(loadu(x + i)));
  if (i < n) {
    float buf[kW] = {};
    std::memcpy(buf, x + i, size_t(n - i) * 4);
    storeu(buf, f(loadu(buf)));
    std::memcpy(out + i, buf, size_t(n - i) * 4);
  }
}
#endif

void gelu(const float* x, float* out, int64_t i0, int64_t i1, bool tanh) {
#if defined(K_SIMD)
  if (tanh)
    map_v(x + i0, out + i0, i1 - i0, [](simd::V v) { return gelu_tanh_v(v); });
  else
    map_v(x + i0, out + i0, i1 - i0, [](simd::V v) { return gelu_erf_v(v); });
#else
  for (int64_t i = i0; i < i1; ++i) {
    const float v = x[i];
    out[i] = tanh ? v / (1.0f + std::exp(v * (-1.5957691216057f + -0.0713548162726f * (v * v))))
                  : v * 0.5f * std::erfc(v * -0.707106781186547524f);
  }
#endif
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
#if defined(K_SIMD)
    using namespace simd;
    const V one = set1(1.0f);
    for (; k + kW <= n; k += kW) {
      const V gv = loadu(g + k);
      const V sv = div(gv, add(one, exp(sub(zero(), gv))));
      storeu(o + k, mul(sv, loadu(u + k)));
    }
#endif
    for (; k < n; ++k) o[k] = (g[k] / (1.0f + std::exp(-g[k]))) * u[k];
  }
}

// out = gelu_tanh(gate) * up, the gate through gelu's own code (its value bit for bit)
void geglu(const float* gu, float* out, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* u = gu + r * 2 * n + n;
    float* o = out + r * n;
    gelu(gu + r * 2 * n, o, 0, n, true);
    for (int64_t k = 0; k < n; ++k) o[k] = o[k] * u[k];
  }
}

// p[i] = exp(x[i] - mx), returns the sum (fixed order)
inline float exp_sub_sum(const float* x, float* p, int64_t n, float mx) {
  int64_t k = 0;
  float sum = 0.0f;
#if defined(K_SIMD)
  using namespace simd;
  V acc = zero();
  const V vm = set1(mx);
  for (; k + kW <= n; k += kW) {
    const V e = exp(sub(loadu(x + k), vm));
    storeu(p + k, e);
    acc = add(acc, e);
  }
  sum = reduce_add(acc);
#endif
  for (; k < n; ++k) {
    p[k] = std::exp(x[k] - mx);
    sum = sum + p[k];
  }
  return sum;
}

// the largest of x[0..n) (the same value in any order: only NaNs, which poison a softmax anyway, could
// come out differently from a scalar loop)
inline float row_max(const float* x, int64_t n) {
  float mx = -INFINITY;
  int64_t k = 0;
#if defined(K_SIMD)
  using namespace simd;
  if (n >= kW) {
    V m = loadu(x);
    for (k = kW; k + kW <= n; k += kW) m = max(m, loadu(x + k));
    mx = reduce_max(m);
  }
#endif
  for (; k < n; ++k) mx = x[k] > mx ? x[k] : mx;
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
#if defined(K_SIMD)
  using namespace simd;
  V acc = zero();
  int64_t k = 0;
  for (; k + kW <= n; k += kW) acc = fmadd(loadu(a + k), loadu(b + k), acc);
#if defined(K_MASK)
  if (k < n) {
    const Mask msk = tail_mask(n - k);
    acc = fmadd(maskz_loadu(msk, a + k), maskz_loadu(msk, b + k), acc);
  }
  return reduce_add(acc);
#else
  float s = reduce_add(acc);
  for (; k < n; ++k) s = s + a[k] * b[k];
  return s;
#endif
#else
  float s = 0.0f;
  for (int64_t k = 0; k < n; ++k) s = s + a[k] * b[k];
  return s;
#endif
}

// y += a * x
inline void axpy(float* y, float a, const float* x, int64_t n) {
  int64_t k = 0;
#if defined(K_SIMD)
  using namespace simd;
  const V va = set1(a);
  for (; k + kW <= n; k += kW) storeu(y + k, fmadd(va, loadu(x + k), loadu(y + k)));
#endif
  for (; k < n; ++k) y[k] = y[k] + a * x[k];
}

// Attention, partial pass. A task is one partition (part_tokens consecutive positions) of
// one group of rows (common.h), for the query heads of one KV head: it reads that KV head's part of
// the stretch of the cache once, front to back. It
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

// s -> cap * tanh(s / cap) for n scores in place (Gemma 2's soft-capping)
inline void softcap_scores(float* s, int64_t n, float cap) {
#if defined(K_SIMD)
  using namespace simd;
  const V c = set1(cap);
  map_v(s, s, n, [c](V v) { return mul(c, tanh(div(v, c))); });
#else
  for (int64_t k = 0; k < n; ++k) s[k] = cap * std::tanh(s[k] / cap);
#endif
}

// softmax statistics of one head's scores sc[0..n) (soft-capped first where the call asks) into its
// partial; sc becomes exp(s - max)
inline void head_softmax(const AttnArgs& a, int64_t seq, int64_t head, int64_t part, float* sc, int64_t n) {
  if (a.softcap > 0.0f) softcap_scores(sc, n, a.softcap);
  const float mx = row_max(sc, n);
  float* po = partial_of(a, seq, head, part);
  po[a.head_dim] = mx;
  po[a.head_dim + 1] = exp_sub_sum(sc, sc, n, mx);
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

// any head_dim: dot / axpy helpers, the output accumulated in scratch; positions [s0, s1) of the
// partition, those the row reads; the query heads of KV head kvh
void attn_part_generic(const AttnArgs& a, int64_t seq, int64_t part, int64_t kvh, float* scores, float* acc) {
  float* tmp = acc + a.head_dim;  // one converted cache row
  const int64_t G = a.num_heads / a.num_kv_heads;
  const int64_t hd = a.head_dim;
  const int64_t P = a.part_tokens;
  const int64_t s0 = imax(part * P, attn_first(a, seq)), s1 = imin<int64_t>(a.seq_lens[seq], part * P + P);
  const int64_t n = s1 - s0;
  if (n <= 0) return;
  const int32_t* bt = a.block_table + seq * a.max_blocks;
  const float* q = a.q + seq * a.q_stride;
  int64_t rows[kMaxPartTokens];
  part_rows(a, bt, s0, n, rows);
  for (int64_t t = s0; t < s1; ++t) {
    const float* kr = kv_row_f32(a, a.k_cache, a.k_scale, rows[t - s0] + kvh * hd, hd, tmp);
    for (int64_t h = kvh * G; h < kvh * G + G; ++h) scores[h * P + (t - s0)] = dot(q + h * hd, kr, hd) * a.scale;
  }
  for (int64_t h = kvh * G; h < kvh * G + G; ++h) head_softmax(a, seq, h, part, scores + h * P, n);
  for (int64_t h = kvh * G; h < kvh * G + G; ++h) {
    for (int64_t i = 0; i < hd; ++i) acc[i] = 0.0f;
    for (int64_t t = s0; t < s1; ++t)
      axpy(acc, scores[h * P + (t - s0)], kv_row_f32(a, a.v_cache, a.v_scale, rows[t - s0] + kvh * hd, hd, tmp), hd);
    std::memcpy(partial_of(a, seq, h, part), acc, size_t(hd) * 4);
  }
}

void attn_partial(const AttnArgs& a, int64_t t0, int64_t t1, float* scratch) {
  for (int64_t task = t0; task < t1; ++task) {
    const int64_t kvh = task % a.num_kv_heads, g = task / a.num_kv_heads / a.max_parts,
                  part = task / a.num_kv_heads % a.max_parts;
    // outside the positions the group reads: past its longest row, or before every row's window
    // (a window's work is O(window), whatever the context)
    if (part * a.part_tokens >= a.group_span[2 * g + 1] || (part + 1) * a.part_tokens <= a.group_span[2 * g])
      continue;
#if defined(K_AVX512)
    if (attn_group_avx512(a, g, part, kvh, scratch)) continue;
#endif
    float* scores = scratch;                             // [num_heads][part_tokens]
    float* acc = scratch + a.num_heads * a.part_tokens;  // [2][head_dim]
    for (int64_t seq = a.groups[g]; seq < a.groups[g + 1]; ++seq) attn_part_generic(a, seq, part, kvh, scores, acc);
  }
}

// the partitions [p0, nparts) a row reads merged in order; a sink logit joins the max and the sum
void attn_combine(const AttnArgs& a, int64_t t0, int64_t t1) {
  const int64_t hd = a.head_dim;
  for (int64_t task = t0; task < t1; ++task) {  // task = seq * num_heads + head
    const int64_t seq = task / a.num_heads;
    const int64_t len = a.seq_lens[seq];
    float* out = a.out + task * hd;
    const int64_t p0 = attn_first(a, seq) / a.part_tokens;
    const int64_t nparts = (len + a.part_tokens - 1) / a.part_tokens;
    const float* base = a.partial + task * a.max_parts * (hd + 2);
    if (nparts <= 0) {
      for (int64_t i = 0; i < hd; ++i) out[i] = 0.0f;
      continue;
    }
    if (nparts - p0 == 1 && !a.sinks) {
      const float* po = base + p0 * (hd + 2);
      const float inv = 1.0f / po[hd + 1];
      for (int64_t i = 0; i < hd; ++i) out[i] = po[i] * inv;
      continue;
    }
    const float sink = a.sinks ? a.sinks[task % a.num_heads] : -INFINITY;
    float mx = sink;
    for (int64_t p = p0; p < nparts; ++p) mx = imax(mx, base[p * (hd + 2) + hd]);
    float total = a.sinks ? std::exp(sink - mx) : 0.0f;
    for (int64_t i = 0; i < hd; ++i) out[i] = 0.0f;
    for (int64_t p = p0; p < nparts; ++p) {
      const float* po = base + p * (hd + 2);
      const float f = std::exp(po[hd] - mx);
      total = total + f * po[hd + 1];
      axpy(out, f, po, hd);
    }
    const float inv = 1.0f / total;
    for (int64_t i = 0; i < hd; ++i) out[i] = out[i] * inv;
  }
}

// ---------------------------------------------------------------------------
// Encoder attention over packed sequences. A task (one head of one query block) copies its
// sequence's K of that head transposed, kt[d][j] (lp = len rounded up to 16 columns, zero past
// len), and its V rows, vp[j][0..dp) (dp = head_dim rounded up to 16), into the thread's scratch;
// then, query rows a tile at a time, the len scores of each row (one multiply-add per d in order,
// keys across lanes), their softmax, and sum_j p_j v_j (j in order, dims across lanes), divided
// by the sum. Which block, tile or thread a row is computed in changes nothing it computes.

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

inline void pack_kv(const PackedAttnArgs& a, int64_t start, int64_t len, int64_t h, int64_t lp, int64_t dp, float* kt,
                    float* vp) {
  const int64_t hd = a.head_dim, H = a.heads * hd;
  const float* k = a.qkv + start * a.row_stride + H + h * hd;
  // one kt row at a time: its stores in sequence (stores a row apart each were a third of the kernel's time)
  for (int64_t d = 0; d < hd; ++d) {
    float* kd = kt + d * lp;
    for (int64_t j = 0; j < len; ++j) kd[j] = k[j * a.row_stride + d];
    for (int64_t j = len; j < lp; ++j) kd[j] = 0.0f;
  }
  for (int64_t j = 0; j < len; ++j) {
    const float* v = k + j * a.row_stride + H;
    for (int64_t d = 0; d < hd; ++d) vp[j * dp + d] = v[d];
    for (int64_t d = hd; d < dp; ++d) vp[j * dp + d] = 0.0f;
  }
}

// 1 / sum of exp(s - max) of each of the nq score rows (stride lp), which become exp(s - max)
inline void softmax_rows(float* s, int64_t lp, int64_t len, int nq, float* inv) {
  for (int i = 0; i < nq; ++i) {
    float* si = s + i * lp;
    inv[i] = 1.0f / exp_sub_sum(si, si, len, row_max(si, len));
  }
}

#if defined(K_SIMD)
constexpr int kPackedQ = 4;                       // query rows per tile
constexpr int kPackedD = simd::kW == 16 ? 4 : 2;  // output vectors per tile (registers: kPackedQ * kPackedD)

// scores of NQ query rows q[i] against keys j0 .. j0 + NK * kW (s: rows lp apart)
template <int NQ, int NK>
inline void score_tile(const float* const* q, const float* kt, int64_t lp, int64_t hd, int64_t j0, float scale,
                       float* s) {
  using namespace simd;
  V acc[NQ][NK];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NK; ++c) acc[i][c] = zero();
  for (int64_t d = 0; d < hd; ++d) {
    V k[NK];
    for (int c = 0; c < NK; ++c) k[c] = loadu(kt + d * lp + j0 + c * kW);
    for (int i = 0; i < NQ; ++i) {
      const V qd = set1(q[i][d]);
      for (int c = 0; c < NK; ++c) acc[i][c] = fmadd(qd, k[c], acc[i][c]);
    }
  }
  const V vs = set1(scale);
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NK; ++c) storeu(s + i * lp + j0 + c * kW, mul(acc[i][c], vs));
}

// o[i][d0 .. d0 + ND * kW) = inv[i] * sum_j p[i][j] v[j] for NQ rows of probabilities p (rows lp apart)
template <int NQ, int ND>
inline void pv_tile(const float* p, int64_t lp, const float* vp, int64_t dp, int64_t len, int64_t d0,
                    const float* inv, float* const* o) {
  using namespace simd;
  V acc[NQ][ND];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < ND; ++c) acc[i][c] = zero();
  for (int64_t j = 0; j < len; ++j) {
    V v[ND];
    for (int c = 0; c < ND; ++c) v[c] = loadu(vp + j * dp + d0 + c * kW);
    for (int i = 0; i < NQ; ++i) {
      const V pj = set1(p[i * lp + j]);
      for (int c = 0; c < ND; ++c) acc[i][c] = fmadd(pj, v[c], acc[i][c]);
    }
  }
  for (int i = 0; i < NQ; ++i) {
    const V vi = set1(inv[i]);
    for (int c = 0; c < ND; ++c) storeu(o[i] + d0 + c * kW, mul(acc[i][c], vi));
  }
}

template <int NQ, int ND>
inline void pv_tile_upto(int nd, const float* p, int64_t lp, const float* vp, int64_t dp, int64_t len, int64_t d0,
                         const float* inv, float* const* o) {
  if constexpr (ND >= 1) {
    if (nd == ND)
      pv_tile<NQ, ND>(p, lp, vp, dp, len, d0, inv, o);
    else
      pv_tile_upto<NQ, ND - 1>(nd, p, lp, vp, dp, len, d0, inv, o);
  }
}

// query rows r0 .. r0 + NQ of head h (head_dim a multiple of kW)
template <int NQ>
void packed_tile(const PackedAttnArgs& a, const float* kt, const float* vp, float* s, int64_t lp, int64_t dp,
                 int64_t len, int64_t r0, int64_t h) {
  using namespace simd;
  const int64_t hd = a.head_dim;
  const float* q[NQ];
  float* o[NQ];
  for (int i = 0; i < NQ; ++i) {
    q[i] = a.qkv + (r0 + i) * a.row_stride + h * hd;
    o[i] = a.out + (r0 + i) * a.heads * hd + h * hd;
  }
  int64_t j0 = 0;
  for (; j0 + 2 * kW <= lp; j0 += 2 * kW) score_tile<NQ, 2>(q, kt, lp, hd, j0, a.scale, s);
  for (; j0 < lp; j0 += kW) score_tile<NQ, 1>(q, kt, lp, hd, j0, a.scale, s);
  float inv[NQ];
  softmax_rows(s, lp, len, NQ, inv);
  for (int64_t d0 = 0; d0 < hd; d0 += kPackedD * kW)
    pv_tile_upto<NQ, kPackedD>(int(imin<int64_t>(kPackedD, (hd - d0) / kW)), s, lp, vp, dp, len, d0, inv, o);
}

template <int NQ>
inline void packed_tile_upto(int nq, const PackedAttnArgs& a, const float* kt, const float* vp, float* s, int64_t lp,
                             int64_t dp, int64_t len, int64_t r0, int64_t h) {
  if constexpr (NQ >= 1) {
    if (nq == NQ)
      packed_tile<NQ>(a, kt, vp, s, lp, dp, len, r0, h);
    else
      packed_tile_upto<NQ - 1>(nq, a, kt, vp, s, lp, dp, len, r0, h);
  }
}
#endif

// query rows [r0, r1) of head h one at a time, any head_dim
void packed_rows_generic(const PackedAttnArgs& a, const float* kt, const float* vp, float* s, float* acc, int64_t lp,
                         int64_t dp, int64_t len, int64_t r0, int64_t r1, int64_t h) {
  const int64_t hd = a.head_dim;
  for (int64_t r = r0; r < r1; ++r) {
    const float* q = a.qkv + r * a.row_stride + h * hd;
    for (int64_t j = 0; j < len; ++j) s[j] = 0.0f;
    for (int64_t d = 0; d < hd; ++d)
      for (int64_t j = 0; j < len; ++j) s[j] = s[j] + q[d] * kt[d * lp + j];
    for (int64_t j = 0; j < len; ++j) s[j] = s[j] * a.scale;
    float inv;
    softmax_rows(s, lp, len, 1, &inv);
    for (int64_t d = 0; d < hd; ++d) acc[d] = 0.0f;
    for (int64_t j = 0; j < len; ++j)
      for (int64_t d = 0; d < hd; ++d) acc[d] = acc[d] + s[j] * vp[j * dp + d];
    float* o = a.out + r * a.heads * hd + h * hd;
    for (int64_t d = 0; d < hd; ++d) o[d] = acc[d] * inv;
  }
}

void attn_packed(const PackedAttnArgs& a, int64_t t0, int64_t t1, float* scratch) {
  const int64_t hd = a.head_dim;
  for (int64_t task = t0; task < t1; ++task) {
    const int64_t blk = task / a.heads, h = task % a.heads;
    const int64_t seq = a.block_seq[blk];
    const int64_t start = a.seq_starts[seq], len = a.seq_starts[seq + 1] - start;
    const int64_t r0 = a.block_row[blk], r1 = imin(r0 + kPackedQueryBlock, start + len);
    const int64_t lp = round16(len), dp = round16(hd);
    float* kt = scratch;        // [hd][lp]
    float* vp = kt + dp * lp;   // [len][dp]
    float* s = vp + lp * dp;    // [8][lp] score rows
    float* acc = s + 8 * lp;    // [dp]
    pack_kv(a, start, len, h, lp, dp, kt, vp);
#if defined(K_SIMD)
    if (hd % simd::kW == 0) {
      for (int64_t r = r0; r < r1; r += kPackedQ)
        packed_tile_upto<kPackedQ>(int(imin<int64_t>(kPackedQ, r1 - r)), a, kt, vp, s, lp, dp, len, r, h);
      continue;
    }
#endif
    packed_rows_generic(a, kt, vp, s, acc, lp, dp, len, r0, r1, h);
  }
}

#if defined(K_AMX_BF16)
#include "attention_amx_bf16.inc"
#endif

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

// ===========================================================================
// matmul_argmax's bounds (see KernelTable). Any rounding here only widens them: c and norm are inflated by the
// caller, and each bound moves by 2^-20 of its size, far more than one rounding.

float argmax_bounds(const float* h, const float* norm, float c, const float* norm2, float c2, int64_t n, float* high,
                    bool* bad) {
  float best = -INFINITY;
  bool nonfinite = false;
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    const int64_t len = n - r0 < 16 ? n - r0 : 16;
#if defined(K_AVX512)
    const __mmask16 k = len == 16 ? __mmask16(0xffff) : __mmask16((1u << len) - 1);
    const __m512 cv = _mm512_set1_ps(c), eps = _mm512_set1_ps(0x1p-20f);
    const __m512 hv = _mm512_maskz_loadu_ps(k, h + r0), nv = _mm512_maskz_loadu_ps(k, norm + r0);
    __m512 low, up;
    if (!norm2) {  // one rounding each: 2^-20 of the result's size covers it
      low = _mm512_fnmadd_ps(cv, nv, hv), up = _mm512_fmadd_ps(cv, nv, hv);
      low = _mm512_fnmadd_ps(_mm512_abs_ps(low), eps, low);
      up = _mm512_fmadd_ps(_mm512_abs_ps(up), eps, up);
    } else {  // three roundings, each within 2^-23 of |h| + b
      const __m512 b = _mm512_fmadd_ps(_mm512_set1_ps(c2), _mm512_maskz_loadu_ps(k, norm2 + r0), _mm512_mul_ps(cv, nv));
      const __m512 slack = _mm512_mul_ps(_mm512_add_ps(_mm512_abs_ps(hv), b), eps);
      low = _mm512_sub_ps(_mm512_sub_ps(hv, b), slack);
      up = _mm512_add_ps(_mm512_add_ps(hv, b), slack);
    }
    up = _mm512_add_ps(up, _mm512_set1_ps(0x1p-100f));
    const __m512 none = _mm512_set1_ps(-INFINITY);
    best = std::max(best, _mm512_reduce_max_ps(_mm512_mask_mov_ps(none, k, low)));
    high[r0 / 16] = _mm512_reduce_max_ps(_mm512_mask_mov_ps(none, k, up));
    nonfinite = nonfinite || _mm512_mask_cmp_ps_mask(k, _mm512_abs_ps(hv), _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ);
#else
    float most = -INFINITY;
    for (int64_t r = r0; r < r0 + len; ++r) {
      float low, up;
      if (!norm2) {
        low = h[r] - c * norm[r], up = h[r] + c * norm[r];
        low -= std::fabs(low) * 0x1p-20f, up += std::fabs(up) * 0x1p-20f;
      } else {
        const float b = c * norm[r] + c2 * norm2[r], slack = (std::fabs(h[r]) + b) * 0x1p-20f;
        low = h[r] - b - slack, up = h[r] + b + slack;
      }
      best = std::max(best, low);
      most = std::max(most, up + 0x1p-100f);
      nonfinite = nonfinite || !(std::fabs(h[r]) <= FLT_MAX);
    }
    high[r0 / 16] = most;
#endif
  }
  *bad = nonfinite;
  return best;
}

uint64_t read_bytes(const uint8_t* p, int64_t n) {
#if defined(K_SIMD)
  using namespace simd;
  VI a0 = zero_bytes(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 4 * kBytes <= n; k += 4 * kBytes) {
    a0 = xor_bytes(a0, loadu_bytes(p + k));
    a1 = xor_bytes(a1, loadu_bytes(p + k + kBytes));
    a2 = xor_bytes(a2, loadu_bytes(p + k + 2 * kBytes));
    a3 = xor_bytes(a3, loadu_bytes(p + k + 3 * kBytes));
  }
  uint64_t h = fold_u64(xor_bytes(xor_bytes(a0, a1), xor_bytes(a2, a3)));
#else
  uint64_t h = 0;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) h ^= load_u64(p + k);
#endif
  for (; k < n; ++k) h += p[k];
  return h;
}

// ===========================================================================
// LoRA: shrink (h = scale * A x) and expand (y += B h) over tokens grouped by adapter

#include "lora.inc"

}  // namespace

const KernelTable* table() {
  static const KernelTable t = {
      CHURON_STR(CHURON_ISA), quantize_act, gemm, dequant_rows, dequant_rows_bf16,
      rms_norm, add_rms_norm, rope, layer_norm, gelu, swiglu, geglu, softmax, attn_partial, attn_combine, attn_packed,
      read_bytes, to_half, argmax_bounds,
#if defined(K_AVX512)
      gemm_coarse,
#else
      nullptr,
#endif
      lora_shrink, lora_expand,
#if defined(K_AMX_BF16)
      gemm_bf16_tiles, gelu_mlp_bf16_tiles, attn_packed_bf16_tiles,
#else
      nullptr, nullptr, nullptr,
#endif
  };
  return &t;
}

}  // namespace CHURON_ISA
}  // namespace churon
