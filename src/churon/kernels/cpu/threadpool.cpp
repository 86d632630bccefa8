// Thread pool: see threadpool.h.
#include "threadpool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CHURON_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define CHURON_PAUSE() asm volatile("yield")
#else
#define CHURON_PAUSE() ((void)0)
#endif

namespace churon {
namespace {

using Clock = std::chrono::steady_clock;

// A thread's share of the current job: [begin, end) packed in one word, claimed with CAS
// (the owner from the front, thieves from the back).
//
// Protocol: the caller writes the job fields (fn, ctx, grain) and `remaining`, then every
// slot word with a release store, then bumps `epoch` (which wakes the workers). A thread reads
// the job fields only *after* a successful claim: its acquire CAS synchronizes with the
// release store of that job's slot word, and the caller cannot start another job before the
// claimed items are done, so the fields it reads are the ones of the items it claimed, even
// if it woke up for an older job.
struct alignas(64) Slot {
  std::atomic<uint64_t> word{0};
};

constexpr int kMaxThreads = 256;

inline uint64_t pack(uint64_t b, uint64_t e) { return (b << 32) | e; }

struct Pool {
  int nthreads = 1;
  std::vector<std::thread>* workers = nullptr;  // leaked (not joined) in a forked child
  bool started = false;

  Slot slots[kMaxThreads];
  alignas(64) std::atomic<uint64_t> epoch{0};
  alignas(64) std::atomic<int64_t> remaining{0};
  alignas(64) std::atomic<int> sleepers{0};
  std::atomic<bool> stop{false};
  std::atomic<bool> busy{false};
  std::atomic<int64_t> spin_ns{300 * 1000};

  std::atomic<RangeFn> fn{nullptr};
  std::atomic<void*> ctx{nullptr};
  std::atomic<int64_t> grain{1};

  std::mutex mu;
  std::condition_variable cv;

  // statistics (caller thread only): jobs, items run by the caller, ns spent waiting at the end
  int64_t st_jobs = 0, st_items = 0, st_caller_items = 0, st_wait_ns = 0, st_long_waits = 0, st_solo_jobs = 0;

  // Solo mode: when the workers get almost no CPU time (other processes own the cores), the
  // caller runs jobs alone for a while, so that its own time slices are not shared with
  // workers that cannot help; the idle workers go to sleep. Decided over windows of jobs.
  int64_t solo_left = 0;
  int64_t win_jobs = 0, win_items = 0, win_worker_items = 0;
  int64_t solo_backoff = 0;
};

constexpr int64_t kWindowJobs = 256;     // jobs per participation measurement
constexpr int64_t kSoloJobs = 2048;      // first solo stretch; doubles while workers stay starved
constexpr int64_t kSoloJobsMax = 65536;

Pool* g_pool = nullptr;
int64_t g_yield_after_ns = 5000;
thread_local bool t_in_worker = false;

bool claim_front(Slot& s, uint64_t grain, uint64_t& b, uint64_t& e) {
  uint64_t w = s.word.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t bb = w >> 32, ee = w & 0xffffffffu;
    if (bb >= ee) return false;
    const uint64_t nb = ee - bb > grain ? bb + grain : ee;
    if (s.word.compare_exchange_weak(w, pack(nb, ee), std::memory_order_acq_rel, std::memory_order_acquire)) {
      b = bb;
      e = nb;
      return true;
    }
  }
}

bool claim_back(Slot& s, uint64_t grain, uint64_t& b, uint64_t& e) {
  uint64_t w = s.word.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t bb = w >> 32, ee = w & 0xffffffffu;
    if (bb >= ee) return false;
    uint64_t take = (ee - bb) / 2;
    if (take < grain) take = grain;
    const uint64_t ne = ee - bb > take ? ee - take : bb;
    if (s.word.compare_exchange_weak(w, pack(bb, ne), std::memory_order_acq_rel, std::memory_order_acquire)) {
      b = ne;
      e = ee;
      return true;
    }
  }
}

inline void execute(Pool& p, uint64_t b, uint64_t e, int tid) {
  const RangeFn fn = p.fn.load(std::memory_order_relaxed);
  void* ctx = p.ctx.load(std::memory_order_relaxed);
  if (tid == 0) p.st_caller_items += int64_t(e - b);
  fn(ctx, int64_t(b), int64_t(e), tid);
  p.remaining.fetch_sub(int64_t(e - b), std::memory_order_acq_rel);
}

void run_share(Pool& p, int tid) {
  const int T = p.nthreads;
  const uint64_t grain = uint64_t(p.grain.load(std::memory_order_relaxed));  // a stale value only sizes claims
  uint64_t b, e;
  while (claim_front(p.slots[tid], grain, b, e)) execute(p, b, e, tid);
  for (int k = 1; k < T; ++k) {
    Slot& s = p.slots[(tid + k) % T];
    while (claim_back(s, grain, b, e)) execute(p, b, e, tid);
  }
}

void worker_main(Pool* p, int tid) {
  t_in_worker = true;
  uint64_t seen = p->epoch.load(std::memory_order_acquire);
  for (;;) {
    uint64_t e;
    Clock::time_point t0 = Clock::now();
    unsigned spins = 0;
    while ((e = p->epoch.load(std::memory_order_acquire)) == seen) {
      if (p->stop.load(std::memory_order_relaxed)) return;
      CHURON_PAUSE();
      if ((++spins & 63) != 0) continue;
      const int64_t spun = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
      // Past a few microseconds, give the CPU away between polls: when the CPUs are
      // oversubscribed (other processes, torch's threads), a spinning worker would otherwise
      // eat the time slices of the thread it waits for. On an idle CPU yield returns at once.
      if (spun > g_yield_after_ns) std::this_thread::yield();
      if (spun > p->spin_ns.load(std::memory_order_relaxed)) {
        std::unique_lock<std::mutex> lk(p->mu);
        p->sleepers.fetch_add(1, std::memory_order_seq_cst);
        p->cv.wait(lk, [&] {
          return p->epoch.load(std::memory_order_seq_cst) != seen || p->stop.load(std::memory_order_relaxed);
        });
        p->sleepers.fetch_sub(1, std::memory_order_seq_cst);
        t0 = Clock::now();
      }
    }
    if (p->stop.load(std::memory_order_relaxed)) return;
    seen = e;
    run_share(*p, tid);
  }
}

void stop_workers(Pool& p) {
  if (!p.workers) return;
  p.stop.store(true);
  {
    std::lock_guard<std::mutex> lk(p.mu);
  }
  p.cv.notify_all();
  for (auto& t : *p.workers) t.join();
  p.workers->clear();
  p.stop.store(false);
  p.started = false;
}

void start_workers(Pool& p) {
  if (p.started) return;
  if (!p.workers) p.workers = new std::vector<std::thread>();
  for (int i = 1; i < p.nthreads; ++i) p.workers->emplace_back(worker_main, &p, i);
  p.started = true;
}

#if defined(__linux__)
void after_fork_child() {
  // The workers do not exist in the child: forget them (never join), reset the sync objects.
  Pool* p = g_pool;
  if (!p) return;
  p->workers = nullptr;
  p->started = false;
  new (&p->mu) std::mutex();
  new (&p->cv) std::condition_variable();
  p->sleepers.store(0);
  p->busy.store(false);
  p->stop.store(false);
}
#endif

Pool& pool() {
  if (!g_pool) {
    g_pool = new Pool();  // never destroyed: workers may still be spinning at exit
    g_pool->nthreads = default_num_threads();
    if (g_pool->nthreads > kMaxThreads) g_pool->nthreads = kMaxThreads;
    if (const char* s = std::getenv("CHURON_SPIN_US")) g_pool->spin_ns.store(int64_t(std::atoll(s)) * 1000);
#if defined(__linux__)
    pthread_atfork(nullptr, nullptr, after_fork_child);
#endif
  }
  return *g_pool;
}

}  // namespace

int default_num_threads() {
  if (const char* s = std::getenv("CHURON_NUM_THREADS")) {
    const int n = std::atoi(s);
    if (n >= 1) return n;
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n >= 1) return n;
  }
#endif
  const unsigned h = std::thread::hardware_concurrency();
  return h ? int(h) : 1;
}

void parallel_for_raw(int64_t n, int64_t grain, RangeFn fn, void* ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  Pool& p = pool();
  if (p.nthreads <= 1 || n <= grain || n >= (int64_t(1) << 31) || t_in_worker ||
      p.busy.exchange(true, std::memory_order_acquire)) {
    fn(ctx, 0, n, 0);
    return;
  }
  if (p.solo_left > 0) {
    p.solo_left--;
    p.st_solo_jobs++;
    fn(ctx, 0, n, 0);
    p.busy.store(false, std::memory_order_release);
    return;
  }
  start_workers(p);
  const int T = p.nthreads;
  p.fn.store(fn, std::memory_order_relaxed);
  p.ctx.store(ctx, std::memory_order_relaxed);
  p.grain.store(grain, std::memory_order_relaxed);
  p.remaining.store(n, std::memory_order_relaxed);
  for (int t = 0; t < T; ++t)
    p.slots[t].word.store(pack(uint64_t(n * t / T), uint64_t(n * (t + 1) / T)), std::memory_order_release);
  p.epoch.fetch_add(1, std::memory_order_seq_cst);
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) {
    {
      std::lock_guard<std::mutex> lk(p.mu);
    }
    p.cv.notify_all();
  }
  const int64_t caller_before = p.st_caller_items;
  run_share(p, 0);
  p.st_jobs++;
  p.st_items += n;
  p.win_jobs++;
  p.win_items += n;
  p.win_worker_items += n - (p.st_caller_items - caller_before);
  if (p.win_jobs >= kWindowJobs) {
    // fair share of the workers: (T-1)/T of the items; starved below a fifth of that
    if (p.win_worker_items * 5 * T < p.win_items * (T - 1)) {
      p.solo_backoff = p.solo_backoff ? std::min<int64_t>(2 * p.solo_backoff, kSoloJobsMax) : kSoloJobs;
      p.solo_left = p.solo_backoff;
    } else {
      p.solo_backoff = 0;
    }
    p.win_jobs = p.win_items = p.win_worker_items = 0;
  }
  if (p.remaining.load(std::memory_order_acquire) != 0) {
    const Clock::time_point w0 = Clock::now();
    unsigned spins = 0;
    while (p.remaining.load(std::memory_order_acquire) != 0) {
      CHURON_PAUSE();
      if (++spins > 100000) std::this_thread::yield();
    }
    const int64_t w = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - w0).count();
    p.st_wait_ns += w;
    if (w > 50000) p.st_long_waits++;
  }
  p.busy.store(false, std::memory_order_release);
}

void set_num_threads(int n) {
  if (n < 1) n = 1;
  if (n > kMaxThreads) n = kMaxThreads;
  Pool& p = pool();
  if (n == p.nthreads) return;
  stop_workers(p);
  p.nthreads = n;
  p.solo_left = p.solo_backoff = p.win_jobs = p.win_items = p.win_worker_items = 0;
}

int get_num_threads() { return pool().nthreads; }

std::vector<int64_t> pool_stats(bool reset) {
  Pool& p = pool();
  std::vector<int64_t> v = {p.st_jobs, p.st_items, p.st_caller_items, p.st_wait_ns, p.st_long_waits, p.st_solo_jobs};
  if (reset) p.st_jobs = p.st_items = p.st_caller_items = p.st_wait_ns = p.st_long_waits = p.st_solo_jobs = 0;
  return v;
}

void set_spin_us(int64_t us) { pool().spin_ns.store(us < 0 ? 0 : us * 1000); }

int64_t get_spin_us() { return pool().spin_ns.load() / 1000; }

void set_yield_after_us(int64_t us) { g_yield_after_ns = us * 1000; }

}  // namespace churon
