// churon CPU kernels: shared declarations.
//
// Two kinds of translation units include this header:
//   * kernels.cpp, compiled once per ISA (scalar, avx2, avx512, amx) with that ISA's flags and
//     -DCHURON_ISA=<name>; each copy fills one KernelTable in namespace churon::<name>.
//   * the module sources, compiled with baseline flags: Python bindings (module.cpp), the
//     runtime choice of a KernelTable (isa.cpp), weight repacking (repack.cpp), the drivers
//     around the kernels (qmatrix.cpp, ops.cpp) and the thread pool (threadpool.cpp).
// Nothing here may use instructions beyond the baseline, since the module sources include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace churon {

// ---------------------------------------------------------------------------
// GGML type ids (gguf.GGMLQuantizationType values) that QMatrix accepts.
enum QType : int {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

// ---------------------------------------------------------------------------
// Repacked weight layout ("x16"): rows are taken 16 at a time (a *group*; the last group is
// padded with zero rows). A group is stored as a sequence of *units*, one per 32 columns
// (Q4_0, Q4_1, Q5_0, Q8_0) or per 256 columns (K-quants). Inside a unit the codes of the 16 rows
// are interleaved so that one 64-byte vector holds 4 consecutive columns of each of the 16
// rows: byte 4*r + t of a vector is row r, column c0 + t. A dot product with one 4-byte
// broadcast of the activations then leaves row r's partial sum in 32-bit lane r (VNNI
// vpdpbusd), and no horizontal reduction is ever needed.
//
// A 32-column *sub-block* of 4-bit codes takes 4 vectors (256 bytes): vector j holds columns
// 4j..4j+3 in its low nibbles and columns 16+4j..16+4j+3 in its high nibbles. Codes are stored
// unsigned (0..15, 0..31, 0..63, 0..255); signed formats are offset and the offset is taken
// out exactly in the integer sum with the activation block sums.
//
//   Q4_0  unit 32 cols, 288 B: nibbles[256] | d f16[16]
//   Q4_1  unit 32 cols, 320 B: nibbles[256] | d f16[16] | m f16[16]
//   Q5_0  unit 32 cols, 352 B: nibbles[256] | qh u64[8] (as Q5_K's, below) | d f16[16]; x = d * (L - 16)
//   Q8_0  unit 32 cols, 544 B: bytes[512] (8 vectors, vector j = columns 4j..4j+3, code+128) | d f16[16]
//   K-quants: a unit is a head (per-row fp16 super-block scales) and 8 sub-blocks of 32
//   columns, each holding everything it needs, so that a unit is read strictly front to back
//   (a layout with separate scale / high-bit regions read Q5_K and Q6_K at a third of the
//   memory bandwidth: the hardware prefetchers lost track of the interleaved streams).
//   Q4_K  unit 256 cols, 2368 B: d f16[16] | dmin f16[16] | 8 x [nibbles 256 | sc u8[16] | mn u8[16]]
//   Q5_K  unit 256 cols, 2880 B: d f16[16] | dmin f16[16] | 8 x [nibbles 256 | qh u64[8] | sc[16] | mn[16]]
//         qh mask v: bit i is the 5th bit of byte i of unpacked vector v (v 0..3: low-nibble
//         vectors, 4..7: high-nibble vectors)
//   Q6_K  unit 256 cols, 3360 B: d f16[16] | 8 x [nibbles 256 | hbits[2][64] | sc i8[2][16]]
//         hbits[h] byte i, bits 2k..2k+1: the top two bits of byte i of unpacked vector k of
//         half h (h 0: low-nibble vectors, 1: high-nibble vectors); sc[h][r]: the scale of row
//         r, columns 16h .. 16h + 15 of the sub-block.
//   F32, F16, BF16: the GGUF rows unchanged (row-major), no groups in memory.
constexpr int kGroupRows = 16;
constexpr int kActBlock = 32;  // activations are quantized in blocks of 32 values

struct QWeights {
  int qtype = 0;
  int64_t rows = 0, cols = 0;
  int64_t ngroups = 0;     // ceil(rows / 16)
  int64_t unit_cols = 0;   // 32, 256, or cols for float types
  int64_t nunits = 0;      // cols / unit_cols
  int64_t unit_bytes = 0;  // bytes of one group-unit (float types: bytes of one row)
  int64_t group_bytes = 0; // nunits * unit_bytes (float types: 16 rows)
  int64_t ldy = 0;         // the output's row stride: rows, or a QMatrixStack's (its parts' sum)
  const uint8_t* data = nullptr;
};

// rows gelu_mlp_bf16_tiles takes at a time: their activation (kMlpRows * down.kp bfloat16) stays in L2 while each
// of its weight matrices is read once from L3 for all of them
constexpr int64_t kMlpRows = 128;

// A matrix in bfloat16 for the AMX-BF16 tiles (matmul_amx_bf16.inc has the layout): rows in groups of 16,
// cols padded with zeros to kp, a multiple of 32
struct Bf16Tiles {
  int64_t rows = 0, cols = 0, kp = 0, ngroups = 0;
  int64_t ldy = 0;  // the output's row stride
  const uint16_t* data = nullptr;
};

// Activations quantized to 8 bits, per 32 values: q = round_half_even(x / d) with
// d = max|x| / 127 (computed as x * (1/d)), and the block sums used by the offset/min terms.
struct ActQ {
  int64_t m = 0, cols = 0, nb = 0;  // nb = cols / 32
  int8_t* q = nullptr;          // [m][cols]
  float* d = nullptr;           // [m][nb]
  float* s = nullptr;           // [m][nb]   d * sum32
  int32_t* sum32 = nullptr;     // [m][nb]
  int32_t* sum16 = nullptr;     // [m][2 * nb]
};

// kKvI8: int8 values with one float32 scale per (slot, kv head): x = q * scale, scale = amax / 127
enum KvDtype : int { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2, kKvI8 = 3 };

// attn_partial's tasks: (group, partition, KV head) triples, group-major, then partition. A group is up
// to kAttnGroupRows consecutive query rows that read the same cache (the tokens of one sequence in a
// step: a prefill chunk, a speculative verification): a task reads one KV head's part of a partition
// once for all of its rows and that head's query heads. Which group a row is in changes nothing it
// computes. A driver runs num_groups * max_parts * num_kv_heads tasks (per KV head, not per partition:
// one sequence's 11 partitions at 700 tokens of context left one of 2 threads idle a sixth of the time).
// A row of length len reads positions [attn_first, len): all of them, or with a sliding window the
// last `window` (a key at distance >= window from the query, at position len - 1, is masked).
constexpr int64_t kAttnGroupRows = 16;

struct AttnArgs {
  const float* q;            // [num_seqs, q_stride] : head h at q + seq * q_stride + h * head_dim
  const void* k_cache;       // [num_blocks, block_size, num_kv_heads, head_dim] of kv_dtype
  const void* v_cache;
  int kv_dtype;              // kKvF32, kKvF16, kKvBF16, kKvI8
  const float* k_scale;      // kKvI8 only: [num_blocks, block_size, num_kv_heads]
  const float* v_scale;
  const int32_t* block_table;  // [num_seqs, max_blocks]
  const int32_t* seq_lens;     // [num_seqs]
  float* out;                // [num_seqs, num_heads * head_dim]
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride;
  float scale;
  int64_t window;            // sliding window in positions, 0: none
  float softcap;             // 0: none; else a score s becomes softcap * tanh(s / softcap) (Gemma 2)
  const float* sinks;        // null: none; else [num_heads] logits that join each head's softmax
                             // denominator only (gpt-oss's attention sinks)
  int64_t part_tokens;       // tokens per partition (fixed, independent of thread count)
  int64_t max_parts;         // partitions of the longest sequence
  float* partial;            // [num_seqs, num_heads, max_parts, head_dim + 2]: o[head_dim], max, sum
  const int64_t* groups;     // [num_groups + 1]: group g is rows [groups[g], groups[g + 1])
  // [num_groups, max_blocks]: the id of every block some row of g reads (they agree on it); the
  // entries of blocks no row of g reads are undefined
  const int32_t* group_blocks;
  const int64_t* group_span;  // [num_groups, 2]: the positions the rows of g read, [first, end), one run
  int64_t num_groups;
};

// the first position row seq reads (its window's first, or 0)
static inline int64_t attn_first(const AttnArgs& a, int64_t seq) {
  return a.window > 0 && a.seq_lens[seq] > a.window ? a.seq_lens[seq] - a.window : 0;
}

// Encoder attention over sequences packed back to back (attention_packed): every query row of a
// sequence against all of that sequence's rows. A task is one head of one block of at most
// kPackedQueryBlock query rows of one sequence; tasks are numbered block-major, then head.
constexpr int64_t kPackedQueryBlock = 64;
// on the AMX-BF16 tiles (attn_packed_bf16_tiles), whose task first packs its sequence's keys and values for the
// tiles: blocks of up to 256 rows, so that a sequence as long as most embedding models take is packed once a head
constexpr int64_t kPackedTileQueryBlock = 256;

// floats of the per-thread scratch of attn_packed_bf16_tiles (attention_amx_bf16.inc) for sequences of at most
// max_len rows: k's and v's tiles, q's A tiles, the scores, the softmax weights, the output tile
static inline int64_t packed_bf16_scratch_floats(int64_t max_len, int64_t head_dim) {
  const int64_t l32 = (max_len + 31) / 32 * 32;
  const int64_t q_rows = l32 < kPackedTileQueryBlock ? l32 : kPackedTileQueryBlock;
  return l32 * head_dim + q_rows / 2 * head_dim + 16 * l32 + 8 * l32 + 16 * head_dim + 256;
}

struct PackedAttnArgs {
  const float* qkv;           // [tokens, row_stride]: q, k, v of head h at columns h*hd, H + h*hd, 2H + h*hd
  int64_t row_stride;
  const int64_t* seq_starts;  // [n_seqs + 1]
  const int64_t* block_seq;   // [n_blocks]: the sequence of each query block
  const int64_t* block_row;   // [n_blocks]: its first query row
  float* out;                 // [tokens, H]
  int64_t heads, head_dim;    // H = heads * head_dim
  float scale;
};

// floats of attn_packed's per-thread scratch for sequences of at most max_len rows
static inline int64_t packed_attn_scratch_floats(int64_t max_len, int64_t head_dim) {
  const int64_t lp = (max_len + 15) / 16 * 16, dp = (head_dim + 15) / 16 * 16;
  return dp * lp + lp * dp + 8 * lp + 8 * dp + 64;
}

// LoRA (lora_add): y[t] += B_s (scale_t * (A_s x[t])) for the tokens t of adapter slot s, in two
// passes over the tokens grouped by slot (order: token indices, slot by slot). shrink: h[p][r] =
// scale * dot(A_s[r], x[order[p]]) for r in [r0, r1); expand: y[order[p]][o] += sum over r in
// [r0, r1) of Bt_s[r][o] * h[p][r] for o in [o0, o1), one *band* of B: the outputs whose nonzero
// entries lie in those ranks (a fused qkv or gate_up B is block-diagonal: each part's outputs read
// only its own ranks). A task covers kLoraTokens positions of one slot and kLoraRanks ranks (shrink)
// or kLoraOuts outputs of one band (expand); each (token, r) dot product and each (token, o) sum has
// one fixed order whoever computes it, with whatever other tokens.
constexpr int64_t kLoraTokens = 16;
constexpr int64_t kLoraRanks = 16;
constexpr int64_t kLoraOuts = 256;

// lora_add's slot table, kLoraFields int64 per slot: the address of A [rank, in], of B transposed
// [rank, out] (float32, row-major), the rank, the address of the bands (int64 [n, 4]: o0, o1, r0, r1)
// and their count n; all 0 for a slot without an adapter.
constexpr int64_t kLoraFields = 5;

struct LoraArgs {
  const float* x;          // [tokens, x_stride]
  float* y;                // [tokens, y_stride]
  int64_t x_stride, y_stride, in, out;
  const int32_t* order;    // [grouped tokens]: token indices, grouped by slot
  const float* scales;     // [tokens]
  const int64_t* table;    // [slots, kLoraFields]
  float* h;                // [grouped tokens, h_stride]: scale * A x
  int64_t h_stride;
};

struct LoraTask {
  int64_t slot, p0, p1;  // positions [p0, p1) of order
  int64_t o0, o1;        // outputs (expand)
  int64_t r0, r1;        // ranks
};

static inline const float* lora_a(const LoraArgs& g, int64_t slot) {
  return reinterpret_cast<const float*>(g.table[slot * kLoraFields]);
}
static inline const float* lora_bt(const LoraArgs& g, int64_t slot) {
  return reinterpret_cast<const float*>(g.table[slot * kLoraFields + 1]);
}

// Everything an ISA provides. Row/group ranges let the caller split work across threads;
// each kernel computes any one row the same way whatever range it is called with.
struct KernelTable {
  const char* name;
  // quantize activation rows [m0, m1) of x (row stride a.cols) into a
  void (*quantize_act)(const float* x, int64_t m0, int64_t m1, const ActQ& a);
  // y[m, rows] for the row groups [g0, g1), all m rows; quantized types use a, float types x
  void (*gemm)(const QWeights& w, const ActQ& a, const float* x, int64_t m, float* y,
               const float* bias, int64_t g0, int64_t g1);
  // dequantize rows [r0, r1) into out (row r at out + (r - r0) * cols); bitwise equal to ggml
  void (*dequant)(const QWeights& w, int64_t r0, int64_t r1, float* out);
  void (*dequant_bf16)(const QWeights& w, int64_t r0, int64_t r1, uint16_t* out);
  void (*rms_norm)(const float* x, const float* w, float* out, int64_t r0, int64_t r1, int64_t n,
                   float eps);
  void (*add_rms_norm)(float* res, const float* x, const float* w, float* out, int64_t r0,
                       int64_t r1, int64_t n, float eps);
  void (*rope)(float* x, int64_t r0, int64_t r1, int64_t n_heads, int64_t head_dim,
               int64_t row_stride, const int64_t* pos, const float* cos, const float* sin);
  // out = LayerNorm(x (+ res when res is not null)) * w + b, rows [r0, r1); out may be x
  void (*layer_norm)(const float* x, const float* res, const float* w, const float* b, float* out, int64_t r0,
                     int64_t r1, int64_t n, float eps);
  // GELU of elements [i0, i1): erf (tanh false) or its tanh approximation; out may be x
  void (*gelu)(const float* x, float* out, int64_t i0, int64_t i1, bool tanh);
  void (*swiglu)(const float* gu, float* out, int64_t r0, int64_t r1, int64_t n);
  void (*geglu)(const float* gu, float* out, int64_t r0, int64_t r1, int64_t n);
  void (*softmax)(const float* x, float* out, int64_t r0, int64_t r1, int64_t n);
  // attention tasks [t0, t1) of (seq, partition); then combine (seq, head) [t0, t1)
  // scratch: attn_scratch_floats(a) floats private to the calling thread
  void (*attn_partial)(const AttnArgs& a, int64_t t0, int64_t t1, float* scratch);
  void (*attn_combine)(const AttnArgs& a, int64_t t0, int64_t t1);
  // packed encoder attention tasks [t0, t1); scratch: packed_attn_scratch_floats floats of the thread
  void (*attn_packed)(const PackedAttnArgs& a, int64_t t0, int64_t t1, float* scratch);
  // read n bytes (a bandwidth probe); returns a value depending on all of them
  uint64_t (*read_bytes)(const uint8_t* p, int64_t n);
  // dst[i] = src[i] as float16 (bf16 false) or bfloat16, round to nearest even
  void (*to_half)(const float* src, uint16_t* dst, int64_t n, bool bf16);
  // QMatrix::matmul_argmax's bounds over n values of a row, h the hi products, value r within b = c * norm[r]
  // (+ c2 * norm2[r] where norm2 is not null) of h[r]: returns the largest value sure to be reached (each h - b
  // lowered by 2^-20 of its size, or of |h| + b with norm2); high[j] = the most a value of [16 j, 16 j + 16) may reach
  // (h + b raised as much, and by 2^-100); *bad: some h is not finite
  float (*argmax_bounds)(const float* h, const float* norm, float c, const float* norm2, float c2, int64_t n,
                         float* high, bool* bad);
  // y[rows] for the row groups [g0, g1): activation row 0 of a times a coarse copy (kCoarseUnitBytes units, c.data;
  // its geometry that of the Q8_0 matrix it was made of). Null where the ISA has none.
  void (*gemm_coarse)(const QWeights& c, const ActQ& a, float* y, int64_t g0, int64_t g1);
  // LoRA tasks [t0, t1): shrink writes h, expand adds to y (see LoraArgs)
  void (*lora_shrink)(const LoraArgs& a, const LoraTask* tasks, int64_t t0, int64_t t1);
  void (*lora_expand)(const LoraArgs& a, const LoraTask* tasks, int64_t t0, int64_t t1);
  // y[m, rows] = bf16(x) bf16(W)^T + bias16 for the row groups [g0, g1) on AMX-BF16 tiles (Bf16Tiles); x:
  // float32 rows of w.cols, bias16: w.ngroups * 16 floats, xb: 32 * w.kp bfloat16 private to the calling
  // thread (x's rows converted there). Null where the ISA has none.
  void (*gemm_bf16_tiles)(const Bf16Tiles& w, const float* x, int64_t m, float* y, const float* bias16,
                          int64_t g0, int64_t g1, uint16_t* xb);
  // rows [0, m) of y = bf16(gelu(bf16(x) bf16(Up)^T + up_bias16)) bf16(Down)^T + down_bias16 on AMX-BF16 tiles,
  // gelu within 5e-7 (erf, or its tanh approximation); up.rows == down.cols, y's row stride down.ldy; xb: 32 *
  // up.kp and hb: kMlpRows * down.kp bfloat16 private to the calling thread. Null where the ISA has none.
  void (*gelu_mlp_bf16_tiles)(const Bf16Tiles& up, const Bf16Tiles& down, const float* x, int64_t m, float* y,
                              const float* up_bias16, const float* down_bias16, bool tanh, uint16_t* xb, uint16_t* hb);
  // attn_packed's tasks on AMX-BF16 tiles, head_dim 32 or 64; scratch: packed_bf16_scratch_floats floats of the
  // thread. Null where the ISA has none.
  void (*attn_packed_bf16_tiles)(const PackedAttnArgs& a, int64_t t0, int64_t t1, float* scratch);
};

namespace scalar { const KernelTable* table(); }
#if defined(CHURON_HAVE_AVX2)
namespace avx2 { const KernelTable* table(); }
#endif
#if defined(CHURON_HAVE_AVX512)
namespace avx512 { const KernelTable* table(); }
#endif
#if defined(CHURON_HAVE_AMX)
namespace amx { const KernelTable* table(); }
#endif

// a group's scores (kAttnGroupRows rows of num_heads heads), one KV head's partition of K and V as
// float32, and a cache row's conversion
static inline int64_t attn_scratch_floats(const AttnArgs& a) {
  return kAttnGroupRows * a.num_heads * a.part_tokens + 2 * a.part_tokens * a.head_dim + 2 * a.head_dim + 64;
}

// ---------------------------------------------------------------------------
// fp16 / bf16 helpers (exact, portable). Every function in this header is `static`: each
// translation unit, whatever its ISA flags, gets its own copy, so the linker can never pick
// an AVX-512 build of a helper for the baseline code.

static inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint32_t bits_from_f32(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

static inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t f;
  if (exp == 0) {
    if (man == 0) {
      f = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      man &= 0x3ff;
      f = sign | (uint32_t(112 - e) << 23) | (man << 13);
    }
  } else if (exp == 31) {
    f = sign | 0x7f800000u | (man << 13);
  } else {
    f = sign | ((exp + 112) << 23) | (man << 13);
  }
  return f32_from_bits(f);
}

static inline float bf16_to_fp32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

// round to nearest even, NaN -> quiet NaN (as c10::BFloat16 does)
static inline uint16_t fp32_to_bf16(float f) {
  uint32_t u = bits_from_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// round to nearest even, overflow to inf, NaN -> quiet NaN (as torch's .to(float16))
static inline uint16_t fp32_to_fp16(float f) {
  uint32_t x = bits_from_f32(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return uint16_t(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (x < 0x38800000u) {  // below 2^-14: a multiple of 2^-24, exact scaling then rounding
    const float scaled = f32_from_bits(x) * 16777216.0f;
    uint32_t m = uint32_t(scaled);
    const float rem = scaled - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  uint32_t h = (((x >> 23) - 112u) << 10) | ((x & 0x7fffffu) >> 13);
  const uint32_t rem = x & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return uint16_t(sign | h);
}

static inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

static inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

static inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// K-quant unit layout: head bytes, sub-block stride, offsets inside a sub-block
static constexpr int kq_head(int qt) { return qt == kQ6_K ? 32 : 64; }
static constexpr int kq_sb(int qt) { return qt == kQ4_K ? 288 : qt == kQ5_K ? 352 : 416; }
static constexpr int kq_sc(int qt) { return qt == kQ4_K ? 256 : qt == kQ5_K ? 320 : 384; }
static constexpr int kq_mn(int qt) { return kq_sc(qt) + 16; }  // Q4_K, Q5_K
constexpr int kQ5Qh = 256;   // Q5_0 / Q5_K qh masks inside a unit / sub-block
constexpr int kQ6Hb = 256;   // Q6_K high bits inside a sub-block

// QMatrix::matmul_argmax's coarse copy of a Q8_0 matrix (one activation row's greedy logits): code q (-128..127) as the 6-bit
// c = min((q + 2) >> 2, 31) + 32, so that q = 4 (c - 32) + a residual of -2..3. x16 units of 32 columns laid out
// as a Q6_K sub-block (256 bytes of low nibbles, the high two bits at kQ6Hb; byte 64 j + 4 n + t: row n, columns
// 4 j + t and 16 + 4 j + t), then the 16 rows' float16 Q8_0 scales: 416 bytes where Q8_0 has 544
constexpr int64_t kCoarseUnitBytes = 416;
constexpr int kCoarseScales = 384;

// unit geometry of the repacked layout
static constexpr int64_t unit_cols_of(int qtype) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ8_0: return 32;
    case kQ4_K: case kQ5_K: case kQ6_K: return 256;
    default: return 0;
  }
}

static constexpr int64_t unit_bytes_of(int qtype) {
  switch (qtype) {
    case kQ4_0: return 288;
    case kQ4_1: return 320;
    case kQ5_0: return 352;
    case kQ8_0: return 544;
    case kQ4_K: return 2368;
    case kQ5_K: return 2880;
    case kQ6_K: return 3360;
    default: return 0;
  }
}

}  // namespace churon
