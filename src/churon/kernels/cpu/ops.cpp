// Row ops and attention (see ops.h): the parallel drivers around the kernels of the current ISA.

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "driver.h"
#include "isa.h"
#include "threadpool.h"

namespace churon {
namespace {

int kv_dtype_of(const std::string& name, const char* what) {
  if (name == "float32") return kKvF32;
  if (name == "float16") return kKvF16;
  if (name == "bfloat16") return kKvBF16;
  if (name == "int8") return kKvI8;
  throw std::invalid_argument(std::string(what) + ": kv_dtype must be 'float32', 'float16', 'bfloat16' or 'int8', got '" +
                              name + "'");
}

// one token's heads x head_dim values into an int8 cache: per head scale = amax / 127 and
// q = round-half-even(x * (127 / amax)), the same arithmetic as the PyTorch reference
void store_kv_i8(int8_t* dst, float* scales, const float* src, int64_t heads, int64_t head_dim) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = src + h * head_dim;
    float amax = 0.0f;
    for (int64_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t i = 0; i < head_dim; ++i)
      dst[h * head_dim + i] = int8_t(std::clamp(std::nearbyint(x[i] * id), -127.0f, 127.0f));
    scales[h] = amax / 127.0f;
  }
}

// dst[i] = src[i] as the cache dtype (round to nearest even)
void store_kv(void* dst, int64_t off, const float* src, int64_t n, int dt) {
  if (dt == kKvF32) {
    std::memcpy(static_cast<float*>(dst) + off, src, size_t(n) * 4);
    return;
  }
  kt()->to_half(src, static_cast<uint16_t*>(dst) + off, n, dt == kKvBF16);
}

// positions per attention task (fixed: batch invariance); at most kMaxPartTokens (256) of kernels.cpp
constexpr int64_t kAttnPartTokens = 64;

// attention partials and per-thread scratch (calls are serialized by the GIL)
Buffer g_attn_buf;
std::vector<int64_t> g_attn_groups, g_attn_group_span;  // attention_decode's row groups (AttnArgs)
std::vector<int32_t> g_attn_group_blocks;
Buffer g_packed_buf;  // attention_packed: its blocks, then per-thread scratch

constexpr int64_t kGeluChunk = 1 << 13;  // values per parallel GELU item

}  // namespace

void rms_norm(uintptr_t xp, uintptr_t wp, uintptr_t outp, int64_t m, int64_t n, double eps) {
  if (m <= 0 || n <= 0) return;
  const float* x = ptr<const float>(xp, "rms_norm: x");
  const float* w = ptr<const float>(wp, "rms_norm: weight");
  float* out = ptr<float>(outp, "rms_norm: out");
  const KernelTable* k = kt();
  rows_op(m, n, [&](int64_t b, int64_t e) { k->rms_norm(x, w, out, b, e, n, float(eps)); });
}

void add_rms_norm(uintptr_t rp, uintptr_t xp, uintptr_t wp, uintptr_t outp, int64_t m, int64_t n, double eps,
                  uintptr_t xnp) {
  if (m <= 0 || n <= 0) return;
  float* res = ptr<float>(rp, "add_rms_norm: residual");
  const float* x = ptr<const float>(xp, "add_rms_norm: x");
  const float* w = ptr<const float>(wp, "add_rms_norm: weight");
  float* out = ptr<float>(outp, "add_rms_norm: out");
  const float* xn = xnp ? ptr<const float>(xnp, "add_rms_norm: x_norm") : nullptr;
  const KernelTable* k = kt();
  rows_op(m, n, [&](int64_t b, int64_t e) {
    if (!xn) {
      k->add_rms_norm(res, x, w, out, b, e, n, float(eps));
      return;
    }
    // the normed x goes through out: a row of it is added to the residual before out's row is written
    k->rms_norm(x, xn, out, b, e, n, float(eps));
    k->add_rms_norm(res, out, w, out, b, e, n, float(eps));
  });
}

void rope(uintptr_t xp, int64_t m, int64_t n_heads, int64_t head_dim, uintptr_t posp, uintptr_t cosp,
          uintptr_t sinp, int64_t row_stride) {
  if (m <= 0 || n_heads <= 0) return;
  if (head_dim <= 0 || head_dim % 2) throw std::invalid_argument("rope: head_dim must be positive and even");
  float* x = ptr<float>(xp, "rope: x");
  const int64_t* pos = ptr<const int64_t>(posp, "rope: positions");
  const float* c = ptr<const float>(cosp, "rope: cos");
  const float* s = ptr<const float>(sinp, "rope: sin");
  if (row_stride == 0) row_stride = n_heads * head_dim;
  const KernelTable* k = kt();
  rows_op(m, n_heads * head_dim,
          [&](int64_t b, int64_t e) { k->rope(x, b, e, n_heads, head_dim, row_stride, pos, c, s); });
}


void rope_and_cache(uintptr_t qkvp, int64_t m, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    uintptr_t posp, uintptr_t cosp, uintptr_t sinp, uintptr_t kcp, uintptr_t vcp, uintptr_t slotp,
                    int64_t row_stride, const std::string& kv_dtype, uintptr_t ksp, uintptr_t vsp, uintptr_t qnp,
                    uintptr_t knp, double eps) {
  const int dt = kv_dtype_of(kv_dtype, "rope_and_cache");
  if ((qnp == 0) != (knp == 0)) throw std::invalid_argument("rope_and_cache: give both q_norm and k_norm, or neither");
  if (m <= 0) return;
  if (head_dim <= 0 || head_dim % 2) throw std::invalid_argument("rope_and_cache: head_dim must be positive and even");
  if (num_heads <= 0 || num_kv_heads <= 0) throw std::invalid_argument("rope_and_cache: head counts must be positive");
  float* qkv = ptr<float>(qkvp, "rope_and_cache: qkv");
  const int64_t* pos = ptr<const int64_t>(posp, "rope_and_cache: positions");
  const float* c = ptr<const float>(cosp, "rope_and_cache: cos");
  const float* s = ptr<const float>(sinp, "rope_and_cache: sin");
  void* kc = ptr<void>(kcp, "rope_and_cache: k_cache");
  void* vc = ptr<void>(vcp, "rope_and_cache: v_cache");
  const int64_t* slots = ptr<const int64_t>(slotp, "rope_and_cache: slot_mapping");
  float* ks = dt == kKvI8 ? ptr<float>(ksp, "rope_and_cache: k_scale") : nullptr;
  float* vs = dt == kKvI8 ? ptr<float>(vsp, "rope_and_cache: v_scale") : nullptr;
  const float* qn = qnp ? ptr<const float>(qnp, "rope_and_cache: q_norm") : nullptr;
  const float* kn = knp ? ptr<const float>(knp, "rope_and_cache: k_norm") : nullptr;
  const int64_t kv = num_kv_heads * head_dim;
  if (row_stride == 0) row_stride = (num_heads + 2 * num_kv_heads) * head_dim;
  const KernelTable* k = kt();
  rows_op(m, row_stride, [&](int64_t b, int64_t e) {
    for (int64_t i = b; qn && i < e; ++i) {  // a head is a row of the norm kernel: rms_norm's bits exactly
      float* row = qkv + i * row_stride;
      k->rms_norm(row, qn, row, 0, num_heads, head_dim, float(eps));
      k->rms_norm(row + num_heads * head_dim, kn, row + num_heads * head_dim, 0, num_kv_heads, head_dim, float(eps));
    }
    k->rope(qkv, b, e, num_heads + num_kv_heads, head_dim, row_stride, pos, c, s);
    for (int64_t i = b; i < e; ++i) {
      if (slots[i] < 0) continue;
      const float* row = qkv + i * row_stride + num_heads * head_dim;
      if (dt == kKvI8) {
        store_kv_i8(static_cast<int8_t*>(kc) + slots[i] * kv, ks + slots[i] * num_kv_heads, row, num_kv_heads, head_dim);
        store_kv_i8(static_cast<int8_t*>(vc) + slots[i] * kv, vs + slots[i] * num_kv_heads, row + kv, num_kv_heads,
                    head_dim);
        continue;
      }
      store_kv(kc, slots[i] * kv, row, kv, dt);
      store_kv(vc, slots[i] * kv, row + kv, kv, dt);
    }
  });
}

void layer_norm(uintptr_t xp, uintptr_t rp, uintptr_t wp, uintptr_t bp, uintptr_t outp, int64_t m, int64_t n,
                double eps) {
  if (m <= 0 || n <= 0) return;
  const float* x = ptr<const float>(xp, "layer_norm: x");
  const float* res = rp ? ptr<const float>(rp, "layer_norm: residual") : nullptr;
  const float* w = ptr<const float>(wp, "layer_norm: weight");
  const float* b = ptr<const float>(bp, "layer_norm: bias");
  float* out = ptr<float>(outp, "layer_norm: out");
  const KernelTable* k = kt();
  rows_op(m, n, [&](int64_t r0, int64_t r1) { k->layer_norm(x, res, w, b, out, r0, r1, n, float(eps)); });
}

void gelu(uintptr_t xp, uintptr_t outp, int64_t n, const std::string& approximate) {
  if (approximate != "none" && approximate != "tanh")
    throw std::invalid_argument("gelu: approximate must be 'none' or 'tanh', got '" + approximate + "'");
  if (n <= 0) return;
  const float* x = ptr<const float>(xp, "gelu: x");
  float* out = ptr<float>(outp, "gelu: out");
  const bool tanh = approximate == "tanh";
  const KernelTable* k = kt();
  if (n < kParallelElems) {
    k->gelu(x, out, 0, n, tanh);
    return;
  }
  const int64_t items = (n + kGeluChunk - 1) / kGeluChunk;
  parallel_for(items, chunk_for(items), [&](int64_t b, int64_t e, int) {
    k->gelu(x, out, b * kGeluChunk, std::min(n, e * kGeluChunk), tanh);
  });
}

namespace {

// a gated activation (swiglu, geglu): out[m, n] from gate_up [m, 2n] by the table's kernel op
void gated(void (*KernelTable::*op)(const float*, float*, int64_t, int64_t, int64_t), const char* gu_what,
           const char* out_what, uintptr_t gup, uintptr_t outp, int64_t m, int64_t n) {
  if (m <= 0 || n <= 0) return;
  const float* gu = ptr<const float>(gup, gu_what);
  float* out = ptr<float>(outp, out_what);
  const KernelTable* k = kt();
  rows_op(m, n, [&](int64_t b, int64_t e) { (k->*op)(gu, out, b, e, n); });
}

}  // namespace

void swiglu(uintptr_t gup, uintptr_t outp, int64_t m, int64_t n) {
  gated(&KernelTable::swiglu, "swiglu: gate_up", "swiglu: out", gup, outp, m, n);
}

void geglu(uintptr_t gup, uintptr_t outp, int64_t m, int64_t n) {
  gated(&KernelTable::geglu, "geglu: gate_up", "geglu: out", gup, outp, m, n);
}

void softmax(uintptr_t xp, uintptr_t outp, int64_t m, int64_t n) {
  if (m <= 0 || n <= 0) return;
  const float* x = ptr<const float>(xp, "softmax: x");
  float* out = ptr<float>(outp, "softmax: out");
  const KernelTable* k = kt();
  rows_op(m, n, [&](int64_t b, int64_t e) { k->softmax(x, out, b, e, n); });
}

void attention_decode(uintptr_t qp, uintptr_t kp, uintptr_t vp, uintptr_t btp, uintptr_t slp, uintptr_t outp,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, double scale, int64_t max_blocks, int64_t q_stride,
                      const std::string& kv_dtype, uintptr_t ksp, uintptr_t vsp, int64_t window, double softcap,
                      uintptr_t sinksp) {
  const int dt = kv_dtype_of(kv_dtype, "attention_decode");
  if (num_seqs <= 0) return;
  if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads)
    throw std::invalid_argument("attention_decode: num_heads must be a positive multiple of num_kv_heads");
  if (head_dim <= 0 || block_size <= 0 || max_blocks <= 0)
    throw std::invalid_argument("attention_decode: head_dim, block_size and max_blocks_per_seq must be positive");
  if (window < 0) throw std::invalid_argument("attention_decode: window must be >= 0, got " + std::to_string(window));
  if (!(softcap >= 0.0 && std::isfinite(softcap)))
    throw std::invalid_argument("attention_decode: softcap must be finite and >= 0, got " + std::to_string(softcap));
  AttnArgs a;
  a.q = ptr<const float>(qp, "attention_decode: q");
  a.k_cache = ptr<const void>(kp, "attention_decode: k_cache");
  a.v_cache = ptr<const void>(vp, "attention_decode: v_cache");
  a.kv_dtype = dt;
  a.k_scale = dt == kKvI8 ? ptr<const float>(ksp, "attention_decode: k_scale") : nullptr;
  a.v_scale = dt == kKvI8 ? ptr<const float>(vsp, "attention_decode: v_scale") : nullptr;
  a.block_table = ptr<const int32_t>(btp, "attention_decode: block_table");
  a.seq_lens = ptr<const int32_t>(slp, "attention_decode: seq_lens");
  a.out = ptr<float>(outp, "attention_decode: out");
  a.num_seqs = num_seqs;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.block_size = block_size;
  a.max_blocks = max_blocks;
  a.q_stride = q_stride ? q_stride : num_heads * head_dim;
  a.scale = float(scale);
  a.window = window;
  a.softcap = float(softcap);
  a.sinks = sinksp ? reinterpret_cast<const float*>(sinksp) : nullptr;
  a.part_tokens = kAttnPartTokens;
  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = a.seq_lens[s];
    if (len < 0 || len > max_blocks * block_size)
      throw std::invalid_argument("attention_decode: seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) +
                                  " does not fit in max_blocks_per_seq * block_size = " +
                                  std::to_string(max_blocks * block_size));
    max_len = std::max(max_len, len);
  }
  a.max_parts = std::max<int64_t>(1, (max_len + a.part_tokens - 1) / a.part_tokens);
  // groups: runs of consecutive rows (the rows of one sequence), at most kAttnGroupRows a group, whose
  // positions read make one run (a row's window may begin after another's end) and whose block tables
  // agree over the blocks two of them read. A group's table is made of its rows' entries for the blocks
  // each reads: entries of other blocks (before a window, past a length) may be garbage, never read.
  g_attn_groups.clear();
  g_attn_group_span.clear();
  g_attn_group_blocks.resize(size_t(num_seqs * max_blocks));
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t lo = attn_first(a, s), hi = a.seq_lens[s];
    const int64_t b0 = lo / block_size, b1 = (hi + block_size - 1) / block_size;  // the blocks s reads
    const int32_t* bt = a.block_table + s * max_blocks;
    const int64_t g = int64_t(g_attn_groups.size()) - 1;
    bool join = g >= 0 && s - g_attn_groups[g] < kAttnGroupRows;
    if (join && hi > 0) {  // a row that reads nothing joins any group
      int64_t& glo = g_attn_group_span[2 * g];
      int64_t& ghi = g_attn_group_span[2 * g + 1];
      int32_t* gb = g_attn_group_blocks.data() + g * max_blocks;
      if (ghi > 0) {  // the group reads some positions: s's must touch them, its blocks agree
        const int64_t c0 = std::max(b0, glo / block_size), c1 = std::min(b1, (ghi + block_size - 1) / block_size);
        join = lo <= ghi && hi >= glo && (c1 <= c0 || !std::memcmp(bt + c0, gb + c0, size_t(c1 - c0) * 4));
      }
      if (join) {
        std::memcpy(gb + b0, bt + b0, size_t(b1 - b0) * 4);
        glo = ghi > 0 ? std::min(glo, lo) : lo;
        ghi = std::max(ghi, hi);
      }
    }
    if (join) continue;
    g_attn_groups.push_back(s);
    g_attn_group_span.push_back(lo);
    g_attn_group_span.push_back(hi);
    std::memcpy(g_attn_group_blocks.data() + (g + 1) * max_blocks + b0, bt + b0, size_t(b1 - b0) * 4);
  }
  a.num_groups = int64_t(g_attn_group_span.size()) / 2;
  g_attn_groups.push_back(num_seqs);
  a.groups = g_attn_groups.data();
  a.group_blocks = g_attn_group_blocks.data();
  a.group_span = g_attn_group_span.data();
  const int64_t partial_floats = num_seqs * num_heads * a.max_parts * (head_dim + 2);
  const int64_t per_thread = (attn_scratch_floats(a) + 15) / 16 * 16;
  const int nthreads = get_num_threads();
  g_attn_buf.reserve(size_t(partial_floats + per_thread * nthreads) * 4 + 64);
  a.partial = reinterpret_cast<float*>(g_attn_buf.p);
  float* scratch = a.partial + (partial_floats + 15) / 16 * 16;
  const KernelTable* k = kt();
  const int64_t ntasks = a.num_groups * a.max_parts * num_kv_heads;
  parallel_for(ntasks, 1, [&](int64_t b, int64_t e, int tid) { k->attn_partial(a, b, e, scratch + tid * per_thread); });
  const int64_t nout = num_seqs * num_heads;
  if (nout * a.max_parts * head_dim >= kParallelElems)  // the partials it reads: a verification's 9 rows at 700 tokens
    parallel_for(nout, chunk_for(nout), [&](int64_t b, int64_t e, int) { k->attn_combine(a, b, e); });
  else
    k->attn_combine(a, 0, nout);
}

void attention_packed(uintptr_t qkvp, uintptr_t startsp, uintptr_t outp, int64_t tokens, int64_t n_seqs,
                      int64_t heads, int64_t head_dim, double scale, int64_t row_stride, bool bf16_tiles) {
  if (heads <= 0 || head_dim <= 0) throw std::invalid_argument("attention_packed: heads and head_dim must be positive");
  const KernelTable* tiles = bf16_tiles ? churon::bf16_tiles() : nullptr;
  if (bf16_tiles && !tiles) throw std::invalid_argument("attention_packed: no AMX-BF16 tiles here");
  if (bf16_tiles && head_dim != 32 && head_dim != 64)
    throw std::invalid_argument("attention_packed: the AMX-BF16 tiles take head_dim 32 or 64, not " +
                                std::to_string(head_dim));
  if (n_seqs < 0 || tokens < 0) throw std::invalid_argument("attention_packed: n_seqs and tokens must not be negative");
  if (row_stride == 0) row_stride = 3 * heads * head_dim;
  if (row_stride < 3 * heads * head_dim)
    throw std::invalid_argument("attention_packed: row_stride " + std::to_string(row_stride) +
                                " is less than 3 * heads * head_dim = " + std::to_string(3 * heads * head_dim));
  const int64_t* starts = ptr<const int64_t>(startsp, "attention_packed: seq_starts");
  if (starts[0] != 0 || starts[n_seqs] != tokens)
    throw std::invalid_argument("attention_packed: seq_starts must run from 0 to tokens = " + std::to_string(tokens));
  const int64_t query_block = tiles ? kPackedTileQueryBlock : kPackedQueryBlock;
  int64_t n_blocks = 0, max_len = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t len = starts[s + 1] - starts[s];
    if (len < 0)
      throw std::invalid_argument("attention_packed: seq_starts decreases at index " + std::to_string(s + 1));
    n_blocks += (len + query_block - 1) / query_block;
    max_len = std::max(max_len, len);
  }
  if (n_blocks == 0) return;
  PackedAttnArgs a;
  a.qkv = ptr<const float>(qkvp, "attention_packed: qkv");
  a.out = ptr<float>(outp, "attention_packed: out");
  a.row_stride = row_stride;
  a.seq_starts = starts;
  a.heads = heads;
  a.head_dim = head_dim;
  a.scale = float(scale);
  const int64_t per_thread =
      ((tiles ? packed_bf16_scratch_floats(max_len, head_dim) : packed_attn_scratch_floats(max_len, head_dim)) + 15) /
      16 * 16;
  const int64_t block_words = (2 * n_blocks + 15) / 16 * 16;
  g_packed_buf.reserve(size_t(block_words * 8 + per_thread * 4 * get_num_threads()) + 64);
  int64_t* block_seq = reinterpret_cast<int64_t*>(g_packed_buf.p);
  int64_t* block_row = block_seq + n_blocks;
  float* scratch = reinterpret_cast<float*>(block_seq + block_words);
  for (int64_t s = 0, b = 0; s < n_seqs; ++s)
    for (int64_t r = starts[s]; r < starts[s + 1]; r += query_block, ++b) {
      block_seq[b] = s;
      block_row[b] = r;
    }
  a.block_seq = block_seq;
  a.block_row = block_row;
  const auto run = tiles ? tiles->attn_packed_bf16_tiles : kt()->attn_packed;
  parallel_for(n_blocks * heads, 1, [&](int64_t b, int64_t e, int tid) { run(a, b, e, scratch + tid * per_thread); });
}

uint64_t read_bytes(uintptr_t p, int64_t nbytes, int64_t repeat) {
  const uint8_t* base = ptr<const uint8_t>(p, "read_bytes: ptr");
  const KernelTable* k = kt();
  const int64_t block = 1 << 16;
  const int64_t nblocks = (nbytes + block - 1) / block;
  uint64_t h[256] = {};
  for (int64_t r = 0; r < repeat; ++r) {
    parallel_for(nblocks, chunk_for(nblocks), [&](int64_t b, int64_t e, int tid) {
      const int64_t lo = b * block, hi = std::min(nbytes, e * block);
      h[tid & 255] ^= k->read_bytes(base + lo, hi - lo);
    });
  }
  uint64_t out = 0;
  for (uint64_t v : h) out ^= v;
  return out;
}

}  // namespace churon
