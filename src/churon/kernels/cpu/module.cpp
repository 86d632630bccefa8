// churon._cpu: Python bindings (pybind11), runtime ISA choice, weight repacking, and the
// parallel drivers around the per-ISA kernels of kernels.cpp.
//
// Kernels take raw addresses (Python ints from tensor.data_ptr()) so that the module never
// links against libtorch. The GIL stays held during a call: calls are short, and releasing it
// would let another Python thread take it and delay our return by up to the switch interval.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "common.h"
#include "threadpool.h"

namespace py = pybind11;

namespace churon {
namespace {

// ---------------------------------------------------------------------------
// ISA selection

struct IsaEntry {
  const char* name;
  const KernelTable* (*table)();
  bool (*supported)();
};

#if (defined(__x86_64__) || defined(__i386__)) && (defined(CHURON_HAVE_AVX2) || defined(CHURON_HAVE_AVX512))
bool cpu_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool cpu_avx512() {
  __builtin_cpu_init();
  return cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}
#endif
bool cpu_any() { return true; }

const std::vector<IsaEntry>& all_isas() {  // best first
  static const std::vector<IsaEntry> v = {
#if defined(CHURON_HAVE_AVX512)
      {"avx512", avx512::table, cpu_avx512},
#endif
#if defined(CHURON_HAVE_AVX2)
      {"avx2", avx2::table, cpu_avx2},
#endif
      {"scalar", scalar::table, cpu_any},
  };
  return v;
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (const auto& e : all_isas())
    if (e.supported()) out.push_back(e.name);
  return out;
}

const KernelTable* g_kt = nullptr;
// Row groups per claim in matmul: ~11 KB of a 576-column Q4_1 matrix. (Measured: 1, 2, 4 and
// 8 are equal within noise; software prefetching in the matmul loop was slower.)
constexpr int64_t kMatmulGrain = 2;

void set_isa(const std::string& name) {
  for (const auto& e : all_isas()) {
    if (name == e.name) {
      if (!e.supported())
        throw std::invalid_argument("ISA '" + name + "' is not supported by this CPU");
      g_kt = e.table();
      return;
    }
  }
  std::string names;
  for (const auto& n : available_isas()) names += (names.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown ISA '" + name + "' (available: " + names + ")");
}

const KernelTable* kt() { return g_kt; }

void init_isa() {
  for (const auto& e : all_isas()) {
    if (e.supported()) {
      g_kt = e.table();
      break;
    }
  }
}

// CHURON_ISA at import: a bad value keeps the best ISA and is reported (isa_error), not fatal
std::string g_isa_error;
void apply_isa_env() {
  const char* env = std::getenv("CHURON_ISA");
  if (!env || !*env) return;
  try {
    set_isa(env);
  } catch (const std::exception& e) {
    g_isa_error = std::string("CHURON_ISA=") + env + ": " + e.what();
  }
}

// ---------------------------------------------------------------------------
// aligned buffers

struct Buffer {
  uint8_t* p = nullptr;
  size_t n = 0;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { std::free(p); }
  void reserve(size_t bytes) {
    if (bytes <= n) return;
    std::free(p);
    p = nullptr;
    n = 0;
    const size_t align = bytes >= (size_t(2) << 20) ? (size_t(2) << 20) : 64;
    const size_t rounded = (bytes + align - 1) / align * align;
    void* q = nullptr;
    if (posix_memalign(&q, align, rounded) != 0 || !q) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align > 64) madvise(q, rounded, MADV_HUGEPAGE);
#endif
    p = static_cast<uint8_t*>(q);
    n = rounded;
  }
};

// scratch for quantized activations and attention partials (calls are serialized by the GIL)
Buffer g_act_buf, g_attn_buf, g_precise_buf;

ActQ make_act(int64_t m, int64_t cols) {
  ActQ a;
  a.m = m;
  a.cols = cols;
  a.nb = cols / kActBlock;
  const size_t q_bytes = size_t(m * cols + 63) / 64 * 64;
  const size_t nbm = size_t(m * a.nb);
  const size_t f_bytes = (nbm * 4 + 63) / 64 * 64;
  g_act_buf.reserve(q_bytes + 3 * f_bytes + 2 * f_bytes);
  uint8_t* p = g_act_buf.p;
  a.q = reinterpret_cast<int8_t*>(p);
  p += q_bytes;
  a.d = reinterpret_cast<float*>(p);
  p += f_bytes;
  a.s = reinterpret_cast<float*>(p);
  p += f_bytes;
  a.sum32 = reinterpret_cast<int32_t*>(p);
  p += f_bytes;
  a.sum16 = reinterpret_cast<int32_t*>(p);
  return a;
}

template <class T>
T* ptr(uintptr_t v, const char* what) {
  if (v == 0) throw std::invalid_argument(std::string(what) + " is a null pointer");
  return reinterpret_cast<T*>(v);
}

// quantize activation rows [0, m) of x into a (in parallel when there are many)
void quantize_rows(const KernelTable* k, const float* x, int64_t m, const ActQ& a) {
  if (m * a.cols >= (1 << 16))
    parallel_for(m, std::max<int64_t>(1, m / (8 * get_num_threads())),
                 [&](int64_t b, int64_t e, int) { k->quantize_act(x, b, e, a); });
  else
    k->quantize_act(x, 0, m, a);
}

// chunk so that each thread gets several chunks (load balance when a core is busy)
int64_t chunk_for(int64_t n, int64_t min_chunk = 1) {
  const int64_t t = get_num_threads();
  return std::max<int64_t>(min_chunk, (n + 8 * t - 1) / (8 * t));
}

// ---------------------------------------------------------------------------
// Repacking GGUF blocks into the x16 layout (see common.h)

const char* qtype_name(int q) {
  switch (q) {
    case kF32: return "F32";
    case kF16: return "F16";
    case kBF16: return "BF16";
    case kQ4_0: return "Q4_0";
    case kQ4_1: return "Q4_1";
    case kQ8_0: return "Q8_0";
    case kQ4_K: return "Q4_K";
    case kQ5_K: return "Q5_K";
    case kQ6_K: return "Q6_K";
    default: return nullptr;
  }
}

// GGUF block geometry: values per block, bytes per block
void gguf_block(int q, int64_t& bs, int64_t& ts) {
  switch (q) {
    case kF32: bs = 1; ts = 4; return;
    case kF16: case kBF16: bs = 1; ts = 2; return;
    case kQ4_0: bs = 32; ts = 18; return;
    case kQ4_1: bs = 32; ts = 20; return;
    case kQ8_0: bs = 32; ts = 34; return;
    case kQ4_K: bs = 256; ts = 144; return;
    case kQ5_K: bs = 256; ts = 176; return;
    case kQ6_K: bs = 256; ts = 210; return;
    default: bs = ts = 0; return;
  }
}

// one row's GGUF block decoded to unsigned codes and raw scale fields
struct Decoded {
  uint8_t code[256];
  uint16_t d = 0, m = 0;   // fp16 bits: d / dmin (K) ; m (Q4_1)
  uint8_t sc[16], mn[8];   // K-quant 6-bit scales / mins; Q6_K: int8 scales (as bytes)
};

void k4_scale_min(const uint8_t* q, int j, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = uint8_t((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    mn = uint8_t((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void decode_block(int q, const uint8_t* b, Decoded& o) {
  switch (q) {
    case kQ4_0:
    case kQ4_1: {
      o.d = load_u16(b);
      const uint8_t* qs = b + (q == kQ4_0 ? 2 : 4);
      if (q == kQ4_1) o.m = load_u16(b + 2);
      for (int j = 0; j < 16; ++j) {
        o.code[j] = qs[j] & 15;
        o.code[j + 16] = qs[j] >> 4;
      }
      break;
    }
    case kQ8_0:
      o.d = load_u16(b);
      for (int j = 0; j < 32; ++j) o.code[j] = uint8_t(b[2 + j] ^ 0x80);  // int8 + 128
      break;
    case kQ4_K:
    case kQ5_K: {
      o.d = load_u16(b);
      o.m = load_u16(b + 2);
      for (int j = 0; j < 8; ++j) k4_scale_min(b + 4, j, o.sc[j], o.mn[j]);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (q == kQ4_K ? 16 : 48);
      for (int s = 0; s < 8; ++s) {
        for (int c = 0; c < 32; ++c) {
          const uint8_t byte = qs[32 * (s / 2) + c];
          int v = (s & 1) ? (byte >> 4) : (byte & 15);
          if (q == kQ5_K) v |= ((qh[c] >> s) & 1) << 4;
          o.code[32 * s + c] = uint8_t(v);
        }
      }
      break;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      for (int n = 0; n < 2; ++n) {
        for (int l = 0; l < 32; ++l) {
          const uint8_t h = qh[32 * n + l];
          const uint8_t a = ql[64 * n + l], c = ql[64 * n + l + 32];
          o.code[128 * n + l] = uint8_t((a & 15) | ((h & 3) << 4));
          o.code[128 * n + l + 32] = uint8_t((c & 15) | (((h >> 2) & 3) << 4));
          o.code[128 * n + l + 64] = uint8_t((a >> 4) | (((h >> 4) & 3) << 4));
          o.code[128 * n + l + 96] = uint8_t((c >> 4) | (((h >> 6) & 3) << 4));
        }
      }
      std::memcpy(o.sc, b + 192, 16);
      o.d = load_u16(b + 208);
      break;
    }
    default:
      break;
  }
}

// place the 4-bit codes of a 32-column sub-block of row r (codes[0..31])
inline void put_nibbles(uint8_t* P, int r, const uint8_t* codes) {
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < 4; ++t)
      P[64 * j + 4 * r + t] = uint8_t((codes[4 * j + t] & 15) | ((codes[16 + 4 * j + t] & 15) << 4));
}

inline void put_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

void repack_unit(int q, uint8_t* P, int r, const Decoded& o) {
  switch (q) {
    case kQ4_0:
    case kQ4_1:
      put_nibbles(P, r, o.code);
      put_u16(P + 256 + 2 * r, o.d);
      if (q == kQ4_1) put_u16(P + 288 + 2 * r, o.m);
      break;
    case kQ8_0:
      for (int c = 0; c < 32; ++c) P[64 * (c >> 2) + 4 * r + (c & 3)] = o.code[c];
      put_u16(P + 512 + 2 * r, o.d);
      break;
    case kQ4_K:
    case kQ5_K:
      for (int s = 0; s < 8; ++s) {
        uint8_t* sb = P + kq_head(q) + s * kq_sb(q);
        put_nibbles(sb, r, o.code + 32 * s);
        sb[kq_sc(q) + r] = o.sc[s];
        sb[kq_mn(q) + r] = o.mn[s];
        if (q == kQ5_K) {
          for (int c = 0; c < 32; ++c) {
            if (!(o.code[32 * s + c] & 16)) continue;
            const int v = c < 16 ? (c >> 2) : 4 + ((c - 16) >> 2);
            uint8_t* mask = sb + kQ5Qh + 8 * v;
            const int bit = 4 * r + (c & 3);
            mask[bit >> 3] |= uint8_t(1u << (bit & 7));
          }
        }
      }
      put_u16(P + 2 * r, o.d);
      put_u16(P + 32 + 2 * r, o.m);
      break;
    case kQ6_K:
      for (int s = 0; s < 8; ++s) {
        uint8_t* sb = P + kq_head(q) + s * kq_sb(q);
        put_nibbles(sb, r, o.code + 32 * s);
        for (int c = 0; c < 32; ++c) {
          const int h = c < 16 ? 0 : 1;
          const int k = (c & 15) >> 2;
          sb[kQ6Hb + 64 * h + 4 * r + (c & 3)] |= uint8_t(((o.code[32 * s + c] >> 4) & 3) << (2 * k));
        }
        sb[kq_sc(q) + r] = o.sc[2 * s];
        sb[kq_sc(q) + 16 + r] = o.sc[2 * s + 1];
      }
      put_u16(P + 2 * r, o.d);
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------------------
// QMatrix

class QMatrix {
 public:
  QMatrix(py::buffer raw, int qtype, int64_t rows, int64_t cols) {
    const char* name = qtype_name(qtype);
    if (!name) {
      throw std::invalid_argument("QMatrix: GGML type id " + std::to_string(qtype) +
                                  " is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)");
    }
    if (rows <= 0 || cols <= 0)
      throw std::invalid_argument("QMatrix: rows and cols must be positive, got " + std::to_string(rows) + " x " +
                                  std::to_string(cols));
    int64_t bs, ts;
    gguf_block(qtype, bs, ts);
    if (cols % bs != 0) {
      throw std::invalid_argument(std::string("QMatrix: ") + name + " needs cols to be a multiple of " +
                                  std::to_string(bs) + ", got " + std::to_string(cols));
    }
    const py::buffer_info info = raw.request();
    const int64_t want = rows * (cols / bs) * ts;
    const int64_t have = int64_t(info.size) * int64_t(info.itemsize);
    if (have != want) {
      throw std::invalid_argument(std::string("QMatrix: a ") + name + " matrix of " + std::to_string(rows) + " x " +
                                  std::to_string(cols) + " needs " + std::to_string(want) + " bytes, got " +
                                  std::to_string(have));
    }
    if (!is_contiguous(info)) throw std::invalid_argument("QMatrix: raw bytes must be contiguous");
    const uint8_t* src = static_cast<const uint8_t*>(info.ptr);

    w_.qtype = qtype;
    w_.rows = rows;
    w_.cols = cols;
    w_.ngroups = (rows + kGroupRows - 1) / kGroupRows;
    if (qtype == kF32 || qtype == kF16 || qtype == kBF16) {
      w_.unit_cols = cols;
      w_.nunits = 1;
      w_.unit_bytes = cols * ts;  // one row
      w_.group_bytes = w_.unit_bytes * kGroupRows;
      buf_.reserve(size_t(want) + 64);
      std::memcpy(buf_.p, src, size_t(want));
      layout_ = std::string(name) + " row-major (GGUF rows unchanged)";
      nbytes_ = want;
    } else {
      w_.unit_cols = unit_cols_of(qtype);
      w_.nunits = cols / w_.unit_cols;
      w_.unit_bytes = unit_bytes_of(qtype);
      w_.group_bytes = w_.nunits * w_.unit_bytes;
      nbytes_ = w_.ngroups * w_.group_bytes;
      buf_.reserve(size_t(nbytes_) + 64);
      uint8_t* dst = buf_.p;
      const int64_t nblocks = cols / bs;  // GGUF blocks per row (= nunits)
      const int64_t ngroups = w_.ngroups;
      const int64_t group_bytes = w_.group_bytes, unit_bytes = w_.unit_bytes;
      auto work = [&](int64_t g0, int64_t g1, int) {
        Decoded o;
        for (int64_t g = g0; g < g1; ++g) {
          uint8_t* gp = dst + g * group_bytes;
          std::memset(gp, 0, size_t(group_bytes));
          for (int r = 0; r < kGroupRows; ++r) {
            const int64_t row = g * kGroupRows + r;
            if (row >= rows) break;  // padding rows stay zero (codes 0, scales +0.0)
            for (int64_t u = 0; u < nblocks; ++u) {
              decode_block(qtype, src + (row * nblocks + u) * ts, o);
              repack_unit(qtype, gp + u * unit_bytes, r, o);
            }
          }
        }
      };
      parallel_for(ngroups, chunk_for(ngroups), work);
      layout_ = std::string(name) + " repacked x16 rows (" + std::to_string(w_.unit_cols) + "-column units of " +
                std::to_string(w_.unit_bytes) + " bytes)";
    }
    w_.data = buf_.p;
  }

  int64_t rows() const { return w_.rows; }
  int64_t cols() const { return w_.cols; }
  int qtype() const { return w_.qtype; }
  const std::string& layout() const { return layout_; }
  int64_t nbytes() const { return nbytes_; }

  bool quantized() const { return !(w_.qtype == kF32 || w_.qtype == kF16 || w_.qtype == kBF16); }

  void matmul(uintptr_t xp, uintptr_t yp, int64_t m, uintptr_t biasp, bool precise) {
    if (m < 0) throw std::invalid_argument("matmul: m must be >= 0");
    if (m == 0) return;
    const float* x = ptr<const float>(xp, "matmul: x");
    float* y = ptr<float>(yp, "matmul: y");
    const float* bias = biasp ? reinterpret_cast<const float*>(biasp) : nullptr;
    const KernelTable* k = kt();
    const QWeights& w = w_;
    const int64_t ng = w_.ngroups;
    if (!quantized()) {
      parallel_for(ng, kMatmulGrain, [&](int64_t b, int64_t e, int) { k->gemm(w, ActQ(), x, m, y, bias, b, e); });
      return;
    }
    const int64_t cols = w_.cols;
    const int64_t mq = precise ? 2 * m : m;  // precise: rows of hi parts, then rows of lo parts
    ActQ a = make_act(mq, cols);
    quantize_rows(k, x, m, a);
    if (!precise) {
      parallel_for(ng, kMatmulGrain, [&](int64_t b, int64_t e, int) { k->gemm(w, a, x, m, y, bias, b, e); });
      return;
    }
    // x = hi + lo: hi = q * d, the 8-bit codes just made; lo = x - hi, quantized in turn at its
    // own (~127x finer) scale; one matmul over both (the weights are read once), then summed.
    g_precise_buf.reserve(size_t(m * cols + mq * w_.rows) * 4 + 64);
    float* lo = reinterpret_cast<float*>(g_precise_buf.p);
    float* y2 = lo + m * cols;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t c = 0; c < cols; ++c)
        lo[i * cols + c] = x[i * cols + c] - float(a.q[i * cols + c]) * a.d[i * a.nb + c / kActBlock];
    ActQ b = a;  // the view of rows m .. 2m - 1
    b.m = m;
    b.q += m * cols;
    b.d += m * a.nb;
    b.s += m * a.nb;
    b.sum32 += m * a.nb;
    b.sum16 += 2 * m * a.nb;
    quantize_rows(k, lo, m, b);
    const int64_t rows = w_.rows, n = m * rows;
    parallel_for(ng, kMatmulGrain, [&](int64_t g0, int64_t g1, int) {
      k->gemm(w, a, nullptr, mq, y2, nullptr, g0, g1);
      const int64_t r0 = g0 * kGroupRows, r1 = std::min(g1 * kGroupRows, rows);
      for (int64_t i = 0; i < m; ++i)  // hi + lo of these rows while they are in cache
        for (int64_t r = r0; r < r1; ++r) {
          const float v = y2[i * rows + r] + y2[n + i * rows + r];
          y[i * rows + r] = bias ? v + bias[r] : v;
        }
    });
  }

  void dequantize(uintptr_t outp) {
    float* out = ptr<float>(outp, "dequantize: out");
    const KernelTable* k = kt();
    const QWeights& w = w_;
    parallel_for(w_.rows, chunk_for(w_.rows, 16), [&](int64_t b, int64_t e, int) { k->dequant(w, b, e, out + b * w.cols); });
  }

  void dequantize_bf16(uintptr_t outp) {
    uint16_t* out = ptr<uint16_t>(outp, "dequantize_bf16: out");
    const KernelTable* k = kt();
    const QWeights& w = w_;
    parallel_for(w_.rows, chunk_for(w_.rows, 16), [&](int64_t b, int64_t e, int) { k->dequant_bf16(w, b, e, out + b * w.cols); });
  }

  // out[i, :] = dequantized row ids[i] (an embedding lookup); ids int64
  void dequantize_rows(uintptr_t idsp, int64_t n, uintptr_t outp) {
    if (n <= 0) return;
    const int64_t* ids = ptr<const int64_t>(idsp, "dequantize_rows: ids");
    float* out = ptr<float>(outp, "dequantize_rows: out");
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= w_.rows)
        throw std::out_of_range("dequantize_rows: row id " + std::to_string(ids[i]) + " is outside [0, " +
                                std::to_string(w_.rows) + ")");
    }
    const KernelTable* k = kt();
    for (int64_t i = 0; i < n; ++i) k->dequant(w_, ids[i], ids[i] + 1, out + i * w_.cols);
  }

 private:
  static bool is_contiguous(const py::buffer_info& info) {
    int64_t stride = info.itemsize;
    for (int i = int(info.ndim) - 1; i >= 0; --i) {
      if (info.shape[i] != 1 && info.strides[i] != stride) return false;
      stride *= info.shape[i];
    }
    return true;
  }

  QWeights w_;
  Buffer buf_;
  std::string layout_;
  int64_t nbytes_ = 0;
};

// ---------------------------------------------------------------------------
// fused ops

constexpr int64_t kParallelElems = 1 << 15;  // below this, a row op runs on the caller only

template <class F>
void rows_op(int64_t m, int64_t n, F&& f) {
  if (m * n >= kParallelElems && m > 1)
    parallel_for(m, chunk_for(m), [&](int64_t b, int64_t e, int) { f(b, e); });
  else
    f(0, m);
}

void rms_norm(uintptr_t xp, uintptr_t wp, uintptr_t outp, int64_t m, int64_t n, double eps) {
  if (m <= 0 || n <= 0) return;
  const float* x = ptr<const float>(xp, "rms_norm: x");
  const float* w = ptr<const float>(wp, "rms_norm: weight");
  float* out = ptr<float>(outp, "rms_norm: out");
  const KernelTable* k = kt();
  rows_op(m, n, [&](int64_t b, int64_t e) { k->rms_norm(x, w, out, b, e, n, float(eps)); });
}

void add_rms_norm(uintptr_t rp, uintptr_t xp, uintptr_t wp, uintptr_t outp, int64_t m, int64_t n, double eps) {
  if (m <= 0 || n <= 0) return;
  float* res = ptr<float>(rp, "add_rms_norm: residual");
  const float* x = ptr<const float>(xp, "add_rms_norm: x");
  const float* w = ptr<const float>(wp, "add_rms_norm: weight");
  float* out = ptr<float>(outp, "add_rms_norm: out");
  const KernelTable* k = kt();
  rows_op(m, n, [&](int64_t b, int64_t e) { k->add_rms_norm(res, x, w, out, b, e, n, float(eps)); });
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

// qkv rows [m, (H + 2 KV) * head_dim] (row_stride floats apart): RoPE on the q and k heads in
// place, then k and v of token i copied into the paged caches at slot slot_mapping[i] (int64;
// negative: not written). Caches [num_blocks * block_size, KV, head_dim] float32.
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

void rope_and_cache(uintptr_t qkvp, int64_t m, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    uintptr_t posp, uintptr_t cosp, uintptr_t sinp, uintptr_t kcp, uintptr_t vcp, uintptr_t slotp,
                    int64_t row_stride, const std::string& kv_dtype, uintptr_t ksp, uintptr_t vsp) {
  const int dt = kv_dtype_of(kv_dtype, "rope_and_cache");
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
  const int64_t kv = num_kv_heads * head_dim;
  if (row_stride == 0) row_stride = (num_heads + 2 * num_kv_heads) * head_dim;
  const KernelTable* k = kt();
  rows_op(m, row_stride, [&](int64_t b, int64_t e) {
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

void swiglu(uintptr_t gup, uintptr_t outp, int64_t m, int64_t n) {
  if (m <= 0 || n <= 0) return;
  const float* gu = ptr<const float>(gup, "swiglu: gate_up");
  float* out = ptr<float>(outp, "swiglu: out");
  const KernelTable* k = kt();
  rows_op(m, n, [&](int64_t b, int64_t e) { k->swiglu(gu, out, b, e, n); });
}

void softmax(uintptr_t xp, uintptr_t outp, int64_t m, int64_t n) {
  if (m <= 0 || n <= 0) return;
  const float* x = ptr<const float>(xp, "softmax: x");
  float* out = ptr<float>(outp, "softmax: out");
  const KernelTable* k = kt();
  rows_op(m, n, [&](int64_t b, int64_t e) { k->softmax(x, out, b, e, n); });
}

constexpr int64_t kAttnPartTokens = 64;  // <= kMaxPartTokens (256) of kernels.cpp
  // positions per attention task (fixed: batch invariance)

void attention_decode(uintptr_t qp, uintptr_t kp, uintptr_t vp, uintptr_t btp, uintptr_t slp, uintptr_t outp,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, double scale, int64_t max_blocks, int64_t q_stride,
                      const std::string& kv_dtype, uintptr_t ksp, uintptr_t vsp) {
  const int dt = kv_dtype_of(kv_dtype, "attention_decode");
  if (num_seqs <= 0) return;
  if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads)
    throw std::invalid_argument("attention_decode: num_heads must be a positive multiple of num_kv_heads");
  if (head_dim <= 0 || block_size <= 0 || max_blocks <= 0)
    throw std::invalid_argument("attention_decode: head_dim, block_size and max_blocks_per_seq must be positive");
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
  const int64_t partial_floats = num_seqs * num_heads * a.max_parts * (head_dim + 2);
  const int64_t per_thread = (attn_scratch_floats(a) + 15) / 16 * 16;
  const int nthreads = get_num_threads();
  g_attn_buf.reserve(size_t(partial_floats + per_thread * nthreads) * 4 + 64);
  a.partial = reinterpret_cast<float*>(g_attn_buf.p);
  float* scratch = a.partial + (partial_floats + 15) / 16 * 16;
  const KernelTable* k = kt();
  const int64_t ntasks = (num_seqs + kAttnQueryBlock - 1) / kAttnQueryBlock * kAttnQueryBlock * a.max_parts;
  parallel_for(ntasks, 1, [&](int64_t b, int64_t e, int tid) { k->attn_partial(a, b, e, scratch + tid * per_thread); });
  const int64_t nout = num_seqs * num_heads;
  if (nout * head_dim >= kParallelElems)
    parallel_for(nout, chunk_for(nout), [&](int64_t b, int64_t e, int) { k->attn_combine(a, b, e); });
  else
    k->attn_combine(a, 0, nout);
}

// bandwidth probe for benchmarks: read nbytes at ptr with all threads, `repeat` times
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

}  // namespace
}  // namespace churon

PYBIND11_MODULE(_cpu, m) {
  using namespace churon;
  m.doc() = "churon native CPU kernels (see src/churon/kernels/cpu/common.h for layouts)";
  init_isa();
  apply_isa_env();
  m.attr("isa_error") = g_isa_error;  // non-empty when CHURON_ISA named an ISA that cannot run

  m.def("isa", [] { return std::string(kt()->name); }, "The ISA whose kernels run now.");
  m.def("available_isas", &available_isas, "ISAs compiled in and supported by this CPU, best first.");
  m.def("set_isa", &set_isa, py::arg("name"), "Switch every kernel to one ISA ('avx512', 'avx2', 'scalar').");
  m.def("set_num_threads", &churon::set_num_threads, py::arg("n"), "Threads used by the kernels, caller included.");
  m.def("get_num_threads", &churon::get_num_threads);
  m.def("set_spin_us", &churon::set_spin_us, py::arg("us"), "How long idle workers spin before sleeping.");
  m.def("get_spin_us", &churon::get_spin_us);
  m.def("_set_yield_after_us", &churon::set_yield_after_us, py::arg("us"));
  m.def("pool_stats", &churon::pool_stats, py::arg("reset") = false,
        "Thread-pool counters since the last reset: [jobs, items, caller_items, wait_ns, long_waits, solo_jobs].");

  m.def("rms_norm", &rms_norm, py::arg("x_ptr"), py::arg("weight_ptr"), py::arg("out_ptr"), py::arg("m"),
        py::arg("n"), py::arg("eps"), "out[m, n] = weight * (x * rsqrt(mean(x^2) + eps)); float32; out may be x.");
  m.def("add_rms_norm", &add_rms_norm, py::arg("residual_ptr"), py::arg("x_ptr"), py::arg("weight_ptr"),
        py::arg("out_ptr"), py::arg("m"), py::arg("n"), py::arg("eps"),
        "residual += x, then out = rms_norm(residual); float32.");
  m.def("rope", &rope, py::arg("x_ptr"), py::arg("m"), py::arg("n_heads"), py::arg("head_dim"),
        py::arg("positions_ptr"), py::arg("cos_ptr"), py::arg("sin_ptr"), py::arg("row_stride") = 0,
        "In-place rotate-half RoPE on x[m, n_heads, head_dim] (token rows row_stride floats apart, 0: packed);"
        " positions int64 [m]; cos/sin float32 [max_pos, head_dim].");
  m.def("rope_and_cache", &rope_and_cache, py::arg("qkv_ptr"), py::arg("m"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("positions_ptr"), py::arg("cos_ptr"), py::arg("sin_ptr"),
        py::arg("k_cache_ptr"), py::arg("v_cache_ptr"), py::arg("slot_mapping_ptr"), py::arg("row_stride") = 0,
        py::arg("kv_dtype") = "float32", py::arg("k_scale_ptr") = 0, py::arg("v_scale_ptr") = 0,
        "On fused qkv rows [m, (num_heads + 2 num_kv_heads) * head_dim]: RoPE on q and k in place, then k and v"
        " of token i written to the paged caches at slot slot_mapping[i] (int64, negative: skipped), converted"
        " to kv_dtype ('float32', 'float16', 'bfloat16': round to nearest even; 'int8': per (slot, kv head)"
        " scale amax / 127 written to the float32 k_scale / v_scale arrays [slots, num_kv_heads]).");
  m.def("swiglu", &swiglu, py::arg("gate_up_ptr"), py::arg("out_ptr"), py::arg("m"), py::arg("n"),
        "out[m, n] = silu(gate) * up, gate_up float32 [m, 2n].");
  m.def("softmax", &softmax, py::arg("x_ptr"), py::arg("out_ptr"), py::arg("m"), py::arg("n"),
        "Row-wise softmax of float32 [m, n]; out may be x.");
  m.def("attention_decode", &attention_decode, py::arg("q_ptr"), py::arg("k_cache_ptr"), py::arg("v_cache_ptr"),
        py::arg("block_table_ptr"), py::arg("seq_lens_ptr"), py::arg("out_ptr"), py::arg("num_seqs"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        py::arg("scale"), py::arg("max_blocks_per_seq"), py::arg("q_stride") = 0, py::arg("kv_dtype") = "float32",
        py::arg("k_scale_ptr") = 0, py::arg("v_scale_ptr") = 0,
        "One query token per sequence against a paged KV cache [num_blocks, block_size, num_kv_heads, head_dim]"
        " of kv_dtype ('float32', 'float16', 'bfloat16', 'int8' with float32 scales [slots, num_kv_heads]); block_table int32 [num_seqs, max_blocks_per_seq],"
        " seq_lens int32 [num_seqs]; out float32 [num_seqs, num_heads * head_dim]; q rows q_stride floats"
        " apart (0: packed).");
  m.def("read_bytes", &read_bytes, py::arg("ptr"), py::arg("nbytes"), py::arg("repeat") = 1,
        "Read memory with all threads (a bandwidth probe for benchmarks).");

  py::class_<QMatrix>(m, "QMatrix")
      .def(py::init<py::buffer, int, int64_t, int64_t>(), py::arg("raw"), py::arg("qtype"), py::arg("rows"),
           py::arg("cols"))
      .def_property_readonly("rows", &QMatrix::rows)
      .def_property_readonly("cols", &QMatrix::cols)
      .def_property_readonly("qtype", &QMatrix::qtype)
      .def_property_readonly("layout", &QMatrix::layout)
      .def_property_readonly("nbytes", &QMatrix::nbytes)
      .def("matmul", &QMatrix::matmul, py::arg("x_ptr"), py::arg("y_ptr"), py::arg("m"), py::arg("bias_ptr") = 0,
           py::arg("precise") = false,
           "y[m, rows] = x[m, cols] @ W^T (+ bias[rows]); float32, C-contiguous. precise: activations at ~16"
           " bits (x = hi + lo, each quantized to 8 bits, one matmul of 2m rows: the same weight traffic,"
           " about twice the compute); no effect for float weights.")
      .def("dequantize", &QMatrix::dequantize, py::arg("out_ptr"),
           "float32 [rows, cols], bitwise equal to churon.formats.quants.dequantize.")
      .def("dequantize_bf16", &QMatrix::dequantize_bf16, py::arg("out_ptr"),
           "bfloat16 [rows, cols] (round to nearest even).")
      .def("dequantize_rows", &QMatrix::dequantize_rows, py::arg("ids_ptr"), py::arg("n"), py::arg("out_ptr"),
           "out[n, cols] = the dequantized rows ids[n] (int64): an embedding lookup.");
}
