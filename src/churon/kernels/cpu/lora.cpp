// lora_add (see ops.h): the step's tokens grouped by adapter slot (a counting sort), then the shrink
// and expand kernels of the current ISA over tasks of one slot each, on the thread pool. Grouping
// reads each adapter's A and B once per kLoraTokens tokens, from cache, instead of once per token;
// the bands skip the zero blocks of a fused matrix's block-diagonal B (two thirds of a qkv B).

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "driver.h"
#include "isa.h"
#include "ops.h"
#include "threadpool.h"

namespace churon {
namespace {

// multiply-adds below which both passes run on the calling thread (a parallel job costs more)
constexpr int64_t kLoraParallelWork = 1 << 16;

// scratch of the call (calls are serialized by the GIL): token order, h, tasks
std::vector<int32_t> g_order;
std::vector<int64_t> g_starts, g_next;
std::vector<LoraTask> g_shrink, g_expand;
Buffer g_h;

}  // namespace

void lora_add(uintptr_t yp, int64_t y_stride, uintptr_t xp, int64_t x_stride, int64_t tokens, int64_t in,
              int64_t out, uintptr_t slotsp, uintptr_t scalesp, uintptr_t tablep, int64_t n_slots) {
  if (tokens < 0 || n_slots < 0) throw std::invalid_argument("lora_add: tokens and n_slots must not be negative");
  if (in <= 0 || out <= 0) throw std::invalid_argument("lora_add: in and out must be positive");
  if (tokens > 1 && (x_stride < in || y_stride < out))
    throw std::invalid_argument("lora_add: x rows are " + std::to_string(x_stride) + " floats apart for " +
                                std::to_string(in) + " features, y rows " + std::to_string(y_stride) + " for " +
                                std::to_string(out));
  if (tokens == 0 || n_slots == 0) return;
  const int32_t* slots = ptr<const int32_t>(slotsp, "lora_add: slots");
  const int64_t* table = ptr<const int64_t>(tablep, "lora_add: slot table");
  for (int64_t s = 0; s < n_slots; ++s) {
    const int64_t* f = table + s * kLoraFields;
    const std::string slot = "lora_add: slot " + std::to_string(s);
    if (f[2] < 0 || (f[2] == 0) != (f[0] == 0) || (f[0] == 0) != (f[1] == 0))
      throw std::invalid_argument(slot + " needs A, B and a positive rank, or none");
    if (f[4] < 0 || (f[4] > 0 && f[3] == 0) || (f[2] == 0 && f[4] > 0))
      throw std::invalid_argument(slot + ": bad band list");
    const int64_t* band = reinterpret_cast<const int64_t*>(f[3]);
    for (int64_t b = 0, end = 0; b < f[4]; end = band[4 * b + 1], ++b) {
      const int64_t* v = band + 4 * b;
      if (v[0] < end || v[1] <= v[0] || v[1] > out || v[2] < 0 || v[3] <= v[2] || v[3] > f[2])
        throw std::invalid_argument(slot + ": band " + std::to_string(b) + " (outputs " + std::to_string(v[0]) + ".." +
                                    std::to_string(v[1]) + ", ranks " + std::to_string(v[2]) + ".." +
                                    std::to_string(v[3]) + ") is not within " + std::to_string(out) +
                                    " outputs and rank " + std::to_string(f[2]) + " after the band before it");
    }
  }

  // counting sort of the tokens by slot, stable; tokens of no slot or of a slot without an adapter drop out
  g_starts.assign(size_t(n_slots) + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t s = slots[t];
    if (s < -1 || s >= n_slots)
      throw std::invalid_argument("lora_add: slots[" + std::to_string(t) + "] = " + std::to_string(s) +
                                  " is not a slot (-1 .. " + std::to_string(n_slots - 1) + ")");
    if (s >= 0 && table[s * kLoraFields + 2] > 0) ++g_starts[size_t(s) + 1];
  }
  for (int64_t s = 0; s < n_slots; ++s) g_starts[size_t(s) + 1] += g_starts[size_t(s)];
  const int64_t grouped = g_starts[size_t(n_slots)];
  if (grouped == 0) return;
  g_order.resize(size_t(grouped));
  g_next.assign(g_starts.begin(), g_starts.end() - 1);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t s = slots[t];
    if (s >= 0 && table[s * kLoraFields + 2] > 0) g_order[size_t(g_next[size_t(s)]++)] = int32_t(t);
  }

  // tasks: kLoraTokens positions of one slot by kLoraRanks ranks (shrink) or kLoraOuts outputs of a band
  // (expand); work counts the multiply-adds
  g_shrink.clear();
  g_expand.clear();
  int64_t max_rank = 0, work = 0;
  for (int64_t s = 0; s < n_slots; ++s) {
    const int64_t* f = table + s * kLoraFields;
    const int64_t rank = f[2];
    const int64_t* band = reinterpret_cast<const int64_t*>(f[3]);
    const int64_t p_end = g_starts[size_t(s) + 1];
    if (g_starts[size_t(s)] < p_end) max_rank = std::max(max_rank, rank);
    for (int64_t p0 = g_starts[size_t(s)]; p0 < p_end; p0 += kLoraTokens) {
      const int64_t p1 = std::min(p0 + kLoraTokens, p_end);
      for (int64_t r = 0; r < rank; r += kLoraRanks)
        g_shrink.push_back({s, p0, p1, 0, 0, r, std::min(r + kLoraRanks, rank)});
      work += (p1 - p0) * rank * in;
      for (int64_t b = 0; b < f[4]; ++b) {
        const int64_t* v = band + 4 * b;
        for (int64_t o = v[0]; o < v[1]; o += kLoraOuts)
          g_expand.push_back({s, p0, p1, o, std::min(o + kLoraOuts, v[1]), v[2], v[3]});
        work += (p1 - p0) * (v[1] - v[0]) * (v[3] - v[2]);
      }
    }
  }

  LoraArgs a;
  a.x = ptr<const float>(xp, "lora_add: x");
  a.y = ptr<float>(yp, "lora_add: y");
  a.x_stride = x_stride;
  a.y_stride = y_stride;
  a.in = in;
  a.out = out;
  a.order = g_order.data();
  a.scales = ptr<const float>(scalesp, "lora_add: scales");
  a.table = table;
  a.h_stride = (max_rank + 15) / 16 * 16;
  g_h.reserve(size_t(grouped * a.h_stride) * 4);
  a.h = reinterpret_cast<float*>(g_h.p);

  const KernelTable* k = kt();
  const int64_t n_shrink = int64_t(g_shrink.size()), n_expand = int64_t(g_expand.size());
  if (work < kLoraParallelWork || get_num_threads() == 1) {
    k->lora_shrink(a, g_shrink.data(), 0, n_shrink);
    k->lora_expand(a, g_expand.data(), 0, n_expand);
    return;
  }
  parallel_for(n_shrink, 1, [&](int64_t b, int64_t e, int) { k->lora_shrink(a, g_shrink.data(), b, e); });
  parallel_for(n_expand, 1, [&](int64_t b, int64_t e, int) { k->lora_expand(a, g_expand.data(), b, e); });
}

}  // namespace churon
