// churon's own thread pool: persistent std::threads that spin briefly after each job, then
// sleep on a condition variable. No OpenMP (torch ships its own libgomp; two OpenMP
// runtimes on the same cores fight).
//
// parallel_for(n, grain, f) runs f(begin, end, tid) over [0, n): thread t first works through
// its own contiguous share [t*n/T, (t+1)*n/T) from the front, `grain` items per claim (one
// memory stream per thread, claims on a cache line nobody else touches), then steals half of
// what is left of another thread's share, from its back. The calling thread takes part
// (tid 0). Kernels compute each item the same way whoever runs it, so results never depend
// on the thread count or on who stole what.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

namespace churon {

using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end, int tid);

void parallel_for_raw(int64_t n, int64_t grain, RangeFn fn, void* ctx);

template <class F>
inline void parallel_for(int64_t n, int64_t grain, F&& f) {
  using Fn = typename std::remove_reference<F>::type;
  parallel_for_raw(
      n, grain,
      [](void* c, int64_t b, int64_t e, int tid) { (*static_cast<Fn*>(c))(b, e, tid); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

void set_num_threads(int n);    // total threads, the caller included; n >= 1
int get_num_threads();
void set_spin_us(int64_t us);   // how long an idle worker spins before it sleeps
int64_t get_spin_us();
void set_yield_after_us(int64_t us);  // spinning workers yield their CPU between polls after this
int default_num_threads();
// jobs, items, items run by the caller, ns the caller waited for workers, waits > 50 us,
// jobs the caller ran alone because the workers were starved of CPU time
std::vector<int64_t> pool_stats(bool reset);      // CHURON_NUM_THREADS, else the CPUs this process may use

}  // namespace churon
