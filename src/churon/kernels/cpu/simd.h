// churon CPU kernels: one SIMD vocabulary over the vector ISAs, as ggml's simd-mappings.h.
//
// A loop in kernels.cpp written once against simd::V (kW floats: 16 on AVX-512, 8 on AVX2) and
// the operations below compiles, in each ISA's copy of kernels.cpp, to that ISA's vectors. A
// mapping fixes its ISA's arithmetic bit for bit: reduce_add and reduce_max are each ISA's own
// reduction tree, and fmadd / fnmadd are the only fused operations (-ffp-contract=off). Where
// the ISAs differ in what they can do the layer says so: K_MASK (AVX-512) means masked loads
// exist, and a loop then finishes with a masked vector step where AVX2 finishes element by
// element.
//
// The scalar copy has no vectors here (K_SIMD undefined) and keeps its plain C++ loops. Loops
// whose shape is an ISA's own are not written against this layer: the integer matmul tiles
// (matmul_<isa>.inc) and the AVX-512 attention kernel (attention_avx512.inc).
//
// Everything is in namespace churon::<isa>, internal linkage (see kernels.cpp).
#pragma once

#include <cstdint>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define K_AVX512 1
#define K_SIMD 1
#define K_MASK 1
#include <immintrin.h>
// the amx copy: AVX-512 and the AMX-INT8 tiles (clang 14 spells the macros without the underscore)
#if (defined(__AMX_INT8__) || defined(__AMXINT8__)) && (defined(__AMX_TILE__) || defined(__AMXTILE__))
#define K_AMX 1
// and its bfloat16 tiles (with AVX512-BF16's conversions), where the compiler knows them
#if (defined(__AMX_BF16__) || defined(__AMXBF16__)) && defined(__AVX512BF16__)
#define K_AMX_BF16 1
#endif
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define K_AVX2 1
#define K_SIMD 1
#include <immintrin.h>
#endif

#ifndef CHURON_ISA
#error "compile with -DCHURON_ISA=<scalar|avx2|avx512|amx>"
#endif

#if defined(K_SIMD)
namespace churon {
namespace CHURON_ISA {
namespace {
namespace simd {

#if defined(K_AVX512)

using V = __m512;
using VI = __m512i;  // kW int32 lanes, or kBytes bytes
constexpr int kW = 16;
constexpr int kBytes = 64;

inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float a) { return _mm512_set1_ps(a); }
inline V loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline V min(V a, V b) { return _mm512_min_ps(a, b); }
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
inline V abs(V a) { return _mm512_abs_ps(a); }
inline V round(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float reduce_add(V a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(V a) { return _mm512_reduce_max_ps(a); }
// a < b ? x : y, lane by lane (false where a or b is NaN)
inline V select_lt(V a, V b, V x, V y) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x); }

// kW float16 / bfloat16 values at p, as float32
inline V load_f16(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline V load_bf16(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// p * 2^n for exp's integral n: scalef takes any n, so exp clamps x only to +-ln(FLT_MAX)
inline V exp_scale(V p, V n) { return _mm512_scalef_ps(p, n); }
constexpr float kExpLo = -88.3762626647949f, kExpHi = 88.3762626647949f;

using Mask = __mmask16;
// the first `left` lanes (all of them when left >= kW)
inline Mask tail_mask(int64_t left) { return left >= kW ? Mask(0xffff) : Mask((1u << left) - 1); }
inline V maskz_loadu(Mask k, const float* p) { return _mm512_maskz_loadu_ps(k, p); }
inline V maskz_sub(Mask k, V a, V b) { return _mm512_maskz_sub_ps(k, a, b); }  // a - b, 0 outside k
inline V maskz_load_f16(Mask k, const void* p) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }
inline V maskz_load_bf16(Mask k, const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

inline VI cvt_i32(V a) { return _mm512_cvtps_epi32(a); }  // round to nearest even
inline VI add_i32(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline int32_t reduce_add_i32(VI a) { return _mm512_reduce_add_epi32(a); }
// the kActBlock int32 of q, saturated to int8, to p
inline void store_i8(int8_t* p, const VI (&q)[kActBlock / kW]) {
  _mm_storeu_si128((__m128i*)p, _mm512_cvtsepi32_epi8(q[0]));
  _mm_storeu_si128((__m128i*)(p + 16), _mm512_cvtsepi32_epi8(q[1]));
}

inline VI zero_bytes() { return _mm512_setzero_si512(); }
inline VI loadu_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI xor_bytes(VI a, VI b) { return _mm512_xor_si512(a, b); }
// a value that depends on every bit of a (read_bytes): the sum of the 64-bit lanes
inline uint64_t fold_u64(VI a) { return uint64_t(_mm512_reduce_add_epi64(a)); }

#elif defined(K_AVX2)

using V = __m256;
using VI = __m256i;  // kW int32 lanes, or kBytes bytes
constexpr int kW = 8;
constexpr int kBytes = 32;

inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float a) { return _mm256_set1_ps(a); }
inline V loadu(const float* p) { return _mm256_loadu_ps(p); }
inline void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline V min(V a, V b) { return _mm256_min_ps(a, b); }
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline V abs(V a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline V round(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// a < b ? x : y, lane by lane (false where a or b is NaN)
inline V select_lt(V a, V b, V x, V y) { return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
inline float reduce_add(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(V a) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// kW float16 / bfloat16 values at p, as float32
inline V load_f16(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline V load_bf16(const void* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// p * 2^n for exp's integral n: 2^n is built in the exponent field, which needs n in
// [-126, 127], so exp clamps x to [-87, 88]
inline V exp_scale(V p, V n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
constexpr float kExpLo = -87.0f, kExpHi = 88.0f;

inline VI cvt_i32(V a) { return _mm256_cvtps_epi32(a); }  // round to nearest even
inline VI add_i32(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline int32_t reduce_add_i32(VI a) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}
// the kActBlock int32 of q, saturated to int8, to p. packs work per 128-bit lane: the
// permutation puts the bytes back in order
inline void store_i8(int8_t* p, const VI (&q)[kActBlock / kW]) {
  const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
  const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
  __m256i b = _mm256_packs_epi16(p01, p23);
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)p, b);
}

inline VI zero_bytes() { return _mm256_setzero_si256(); }
inline VI loadu_bytes(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline VI xor_bytes(VI a, VI b) { return _mm256_xor_si256(a, b); }
// a value that depends on every bit of a (read_bytes): the xor of the 64-bit lanes
inline uint64_t fold_u64(VI a) {
  alignas(32) uint64_t t[4];
  _mm256_store_si256((__m256i*)t, a);
  return t[0] ^ t[1] ^ t[2] ^ t[3];
}

#endif

inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// c[0] x^(N-1) + ... + c[N-1], by Horner's rule: one fmadd a coefficient
template <int N>
inline V horner(V x, const float (&c)[N]) {
  V p = set1(c[0]);
  for (int i = 1; i < N; ++i) p = fmadd(p, x, set1(c[i]));
  return p;
}

// exp for x clamped to [kExpLo, kExpHi]: cephes polynomial, ~1 ulp
inline V exp(V x) {
  x = min(max(x, set1(kExpLo)), set1(kExpHi));
  const V n = round(mul(x, set1(1.44269504088896341f)));
  V r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  V p = horner(r, {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f, 4.1665795894E-2f, 1.6666665459E-1f,
                   5.0000001201E-1f});
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return exp_scale(p, n);
}

// tanh, cephes tanhf (~2 ulp): x + x^3 p(x^2) for |x| < 0.625 (no cancellation near 0), beyond it
// sign(x) (1 - 2 / (exp(2|x|) + 1)), which exp's clamp takes to exactly +-1 for large |x|
inline V tanh(V x) {
  const V ax = abs(x);
  const V s = mul(x, x);
  const V p = horner(s, {-5.70498872745e-3f, 2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f,
                         -3.33332819422e-1f});
  const V near0 = fmadd(mul(p, s), x, x);
  const V t = sub(set1(1.0f), div(set1(2.0f), add(exp(add(ax, ax)), set1(1.0f))));
  return select_lt(ax, set1(0.625f), near0, select_lt(x, zero(), sub(zero(), t), t));
}

// erfc, ~1 ulp of erf's scale everywhere and ~2e-6 relative on the negative-argument side of GELU,
// where 1 + erf(x) = erfc(-x) would otherwise cancel. |x| < 0.9277: 1 - (x + x r(x^2)); beyond,
// e = exp(p(|x|)) with p a fit of log erfc on [0.9277, 4] (Chebyshev nodes, float32 Horner checked
// against double erf), erfc = e for x > 0 and 2 - e for x < 0; |x| > 4: 0 or 2 (erfc(4) = 1.5e-8).
inline V erfc(V x) {
  const V ax = abs(x);
  const V s = mul(x, x);
  const V r = horner(s, {-5.982479779e-04f, 4.991958849e-03f, -2.676613443e-02f, 1.128181517e-01f,
                         -3.761249483e-01f, 1.283791512e-01f /* 2 / sqrt(pi) - 1 */});
  const V near0 = sub(set1(1.0f), fmadd(x, r, x));
  const V t = min(ax, set1(4.0f));
  const V p = horner(t, {1.613661084e-06f, -4.558263026e-05f, 5.927017191e-04f, -4.739904311e-03f, 2.636381797e-02f,
                         -1.099766791e-01f, -6.319386959e-01f, -1.130165815e+00f, 3.030020744e-04f});
  const V e = select_lt(ax, set1(4.0f), exp(p), zero());
  const V tail = select_lt(x, zero(), sub(set1(2.0f), e), e);
  return select_lt(ax, set1(0.9277f), near0, tail);
}

}  // namespace simd
}  // namespace
}  // namespace CHURON_ISA
}  // namespace churon
#endif
