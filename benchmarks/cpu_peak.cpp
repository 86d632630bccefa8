// The arithmetic peak of one CPU core for the two instructions churon's kernels are made of:
// AVX-512 VNNI vpdpbusd (the quantized matmuls: 64 int8 multiply-adds each) and vfmadd231ps
// zmm (attention and the float kernels: 16 float32 multiply-adds each). Sixteen independent
// accumulator chains, so throughput and not latency bounds the loop.
//
//     g++ -O2 -march=native benchmarks/cpu_peak.cpp -o /tmp/cpu_peak
//     /tmp/cpu_peak & /tmp/cpu_peak; wait     # one process per core: the machine's total
//
// docs/BENCHMARKS.md compares churon's kernels with these figures.
#include <immintrin.h>

#include <chrono>
#include <cstdio>

constexpr long kIters = 200000000;
constexpr int kChains = 16;

template <class F>
double per_second(F&& body) {
  const auto t0 = std::chrono::steady_clock::now();
  body();
  return double(kIters) * kChains / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  __m512i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  const double dp = per_second([&] {
    for (long n = 0; n < kIters; ++n) {
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
      asm volatile("" : "+v"(a), "+v"(b));  // the operands stay opaque: no constant folding
    }
  });
  int isum = 0;
  for (int i = 0; i < kChains; ++i) isum += _mm512_reduce_add_epi32(acc[i]);

  __m512 facc[kChains];
  for (int i = 0; i < kChains; ++i) facc[i] = _mm512_set1_ps(float(i));
  __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
  const double fma = per_second([&] {
    for (long n = 0; n < kIters; ++n) {
      for (int i = 0; i < kChains; ++i) facc[i] = _mm512_fmadd_ps(facc[i], x, y);
      asm volatile("" : "+v"(x), "+v"(y));
    }
  });
  float fsum = 0.0f;
  for (int i = 0; i < kChains; ++i) fsum += _mm512_reduce_add_ps(facc[i]);

  std::printf("vpdpbusd zmm: %.2f G/s = %.0f GMAC/s int8\n", dp / 1e9, dp * 64 / 1e9);
  std::printf("vfmadd zmm:   %.2f G/s = %.0f GMAC/s float32\n", fma / 1e9, fma * 16 / 1e9);
  std::printf("(checksums %d %g)\n", isum, double(fsum));
  return 0;
}
