// churon._cpu: the Python bindings (pybind11) of the native CPU kernels.
//
// Kernels take raw addresses (Python ints from tensor.data_ptr()) so that the module never
// links against libtorch. The GIL stays held during a call: calls are short, and releasing it
// would let another Python thread take it and delay our return by up to the switch interval.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "isa.h"
#include "ops.h"
#include "qmatrix.h"
#include "threadpool.h"

namespace py = pybind11;

namespace churon {
namespace {

bool is_contiguous(const py::buffer_info& info) {
  int64_t stride = info.itemsize;
  for (int i = int(info.ndim) - 1; i >= 0; --i) {
    if (info.shape[i] != 1 && info.strides[i] != stride) return false;
    stride *= info.shape[i];
  }
  return true;
}

}  // namespace
}  // namespace churon

PYBIND11_MODULE(_cpu, m) {
  using namespace churon;
  m.doc() = "churon native CPU kernels (see src/churon/kernels/cpu/common.h for layouts)";
  m.attr("isa_error") = init_isa();  // non-empty when CHURON_ISA named an ISA that cannot run

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
        py::arg("out_ptr"), py::arg("m"), py::arg("n"), py::arg("eps"), py::arg("x_norm_ptr") = 0,
        "residual += x (with x_norm_ptr: += rms_norm(x, x_norm), bitwise), then out = rms_norm(residual); float32;"
        " x is not written.");
  m.def("rope", &rope, py::arg("x_ptr"), py::arg("m"), py::arg("n_heads"), py::arg("head_dim"),
        py::arg("positions_ptr"), py::arg("cos_ptr"), py::arg("sin_ptr"), py::arg("row_stride") = 0,
        "In-place rotate-half RoPE on x[m, n_heads, head_dim] (token rows row_stride floats apart, 0: packed);"
        " positions int64 [m]; cos/sin float32 [max_pos, head_dim].");
  m.def("rope_and_cache", &rope_and_cache, py::arg("qkv_ptr"), py::arg("m"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("positions_ptr"), py::arg("cos_ptr"), py::arg("sin_ptr"),
        py::arg("k_cache_ptr"), py::arg("v_cache_ptr"), py::arg("slot_mapping_ptr"), py::arg("row_stride") = 0,
        py::arg("kv_dtype") = "float32", py::arg("k_scale_ptr") = 0, py::arg("v_scale_ptr") = 0,
        py::arg("q_norm_ptr") = 0, py::arg("k_norm_ptr") = 0, py::arg("eps") = 0.0,
        "On fused qkv rows [m, (num_heads + 2 num_kv_heads) * head_dim]: with q_norm / k_norm (float32"
        " [head_dim], both or neither) each q and k head RMS-normalized in place first (eps), as rms_norm does;"
        " RoPE on q and k in place, then k and v"
        " of token i written to the paged caches at slot slot_mapping[i] (int64, negative: skipped), converted"
        " to kv_dtype ('float32', 'float16', 'bfloat16': round to nearest even; 'int8': per (slot, kv head)"
        " scale amax / 127 written to the float32 k_scale / v_scale arrays [slots, num_kv_heads]).");
  m.def("layer_norm", &layer_norm, py::arg("x_ptr"), py::arg("residual_ptr"), py::arg("weight_ptr"),
        py::arg("bias_ptr"), py::arg("out_ptr"), py::arg("m"), py::arg("n"), py::arg("eps"),
        "out[m, n] = LayerNorm(x + residual) * weight + bias (residual_ptr 0: LayerNorm(x)); float32; x and"
        " residual are not written unless out is one of them.");
  m.def("gelu", &gelu, py::arg("x_ptr"), py::arg("out_ptr"), py::arg("n"), py::arg("approximate") = "none",
        "out[n] = GELU(x), float32; approximate 'none' (erf, as torch) or 'tanh'; out may be x.");
  m.def("swiglu", &swiglu, py::arg("gate_up_ptr"), py::arg("out_ptr"), py::arg("m"), py::arg("n"),
        "out[m, n] = silu(gate) * up, gate_up float32 [m, 2n].");
  m.def("geglu", &geglu, py::arg("gate_up_ptr"), py::arg("out_ptr"), py::arg("m"), py::arg("n"),
        "out[m, n] = gelu(gate, approximate='tanh') * up, gate_up float32 [m, 2n].");
  m.def("softmax", &softmax, py::arg("x_ptr"), py::arg("out_ptr"), py::arg("m"), py::arg("n"),
        "Row-wise softmax of float32 [m, n]; out may be x.");
  m.def("attention_decode", &attention_decode, py::arg("q_ptr"), py::arg("k_cache_ptr"), py::arg("v_cache_ptr"),
        py::arg("block_table_ptr"), py::arg("seq_lens_ptr"), py::arg("out_ptr"), py::arg("num_seqs"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        py::arg("scale"), py::arg("max_blocks_per_seq"), py::arg("q_stride") = 0, py::arg("kv_dtype") = "float32",
        py::arg("k_scale_ptr") = 0, py::arg("v_scale_ptr") = 0, py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks_ptr") = 0,
        "One query token per sequence against a paged KV cache [num_blocks, block_size, num_kv_heads, head_dim]"
        " of kv_dtype ('float32', 'float16', 'bfloat16', 'int8' with float32 scales [slots, num_kv_heads]); block_table int32 [num_seqs, max_blocks_per_seq],"
        " seq_lens int32 [num_seqs]; out float32 [num_seqs, num_heads * head_dim]; q rows q_stride floats"
        " apart (0: packed). window > 0: a row of length len reads positions [max(0, len - window), len) only (its"
        " table's entries for blocks wholly before them are not read); softcap > 0: scores s become softcap *"
        " tanh(s / softcap); sinks_ptr: float32 [num_heads] logits in each head's softmax denominator only.");
  m.def("attention_packed", &attention_packed, py::arg("qkv_ptr"), py::arg("seq_starts_ptr"), py::arg("out_ptr"),
        py::arg("tokens"), py::arg("n_seqs"), py::arg("heads"), py::arg("head_dim"), py::arg("scale"),
        py::arg("row_stride") = 0,
        "Bidirectional attention over sequences packed back to back: qkv float32 rows [tokens] row_stride"
        " floats apart (0: 3 * heads * head_dim) holding q, k, v in columns [0, H), [H, 2H), [2H, 3H), H ="
        " heads * head_dim; seq_starts int64 [n_seqs + 1] (0, len0, len0 + len1, ..., tokens); out float32"
        " [tokens, H]. Each row's result is the same whatever else is packed with it and whatever the"
        " thread count.");
  m.def("lora_add", &lora_add, py::arg("y_ptr"), py::arg("y_stride"), py::arg("x_ptr"), py::arg("x_stride"),
        py::arg("tokens"), py::arg("in_features"), py::arg("out_features"), py::arg("slots_ptr"), py::arg("scales_ptr"),
        py::arg("table_ptr"), py::arg("n_slots"),
        "In place: y[t] += B_s @ (scales[t] * (A_s @ x[t])) for each token t whose slot s = slots[t] (int32,"
        " -1: none) has an adapter; x float32 [tokens, in] and y [tokens, out], rows x_stride / y_stride"
        " floats apart; scales float32 [tokens]. table int64 [n_slots, 5], per slot: the address of A"
        " [rank, in] and of B transposed [rank, out] (float32, row-major), the rank, the address of its"
        " bands (int64 [n, 4]: outputs [o0, o1) read ranks [r0, r1) of B, ascending and disjoint; outputs"
        " in no band get nothing) and n; all 0 where the slot has no adapter. A token's result depends"
        " only on its own row, slot and scale.");
  m.def("read_bytes", &read_bytes, py::arg("ptr"), py::arg("nbytes"), py::arg("repeat") = 1,
        "Read memory with all threads (a bandwidth probe for benchmarks).");

  py::class_<QMatrix>(m, "QMatrix")
      .def(py::init([](py::buffer raw, int qtype, int64_t rows, int64_t cols) {
             const py::buffer_info info = raw.request();
             return new QMatrix(static_cast<const uint8_t*>(info.ptr), int64_t(info.size) * int64_t(info.itemsize),
                                is_contiguous(info), qtype, rows, cols);
           }),
           py::arg("raw"), py::arg("qtype"), py::arg("rows"), py::arg("cols"))
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

  py::class_<QMatrixStack>(m, "QMatrixStack")
      .def(py::init<const std::vector<const QMatrix*>&>(), py::arg("parts"), py::keep_alive<1, 2>(),
           "QMatrix parts of one column count stacked by rows, run as one matrix (the list is kept alive).")
      .def_property_readonly("rows", &QMatrixStack::rows)
      .def_property_readonly("cols", &QMatrixStack::cols)
      .def_property_readonly("layout", &QMatrixStack::layout)
      .def_property_readonly("nbytes", &QMatrixStack::nbytes)
      .def("matmul", &QMatrixStack::matmul, py::arg("x_ptr"), py::arg("y_ptr"), py::arg("m"), py::arg("bias_ptr") = 0,
           "y[m, rows] = x[m, cols] @ W^T (+ bias[rows]), W the parts stacked; float32, C-contiguous; each"
           " part's columns of y bitwise its own matmul's.");

  py::class_<MoeExperts>(m, "MoeExperts")
      .def(py::init<const std::vector<const QMatrix*>&, const std::vector<const QMatrix*>&>(), py::arg("gate_up"),
           py::arg("down"), py::keep_alive<1, 2>(), py::keep_alive<1, 3>(),
           "An MoE layer's routed experts: gate_up[e] [2 ffn, hidden] (gate rows, then up rows) and down[e]"
           " [hidden, ffn] QMatrix per expert, all experts of one shape (the lists are kept alive).")
      .def_property_readonly("num_experts", &MoeExperts::num_experts)
      .def_property_readonly("hidden", &MoeExperts::hidden)
      .def_property_readonly("ffn", &MoeExperts::ffn)
      .def("forward", &MoeExperts::forward, py::arg("h_ptr"), py::arg("tokens"), py::arg("ids_ptr"),
           py::arg("weights_ptr"), py::arg("k"), py::arg("out_ptr"), py::arg("normalize") = false,
           "out[t] = sum over r < k, in rank order, of w[t, r] * down_e(swiglu(gate_up_e(h[t]))), e ="
           " ids[t, r]: h float32 [tokens, hidden], ids int64 [tokens, k], weights float32 [tokens, k], out"
           " float32 [tokens, hidden], C-contiguous; w = weights, or normalize: weights[t, r] divided by the"
           " sum of weights[t] added in rank order. Bitwise what each expert's matmul, swiglu and the float32"
           " products and sums give one expert at a time, whatever the batch and the thread count. An id"
           " outside [0, num_experts) raises IndexError.")
      .def("forward_routed", &MoeExperts::forward_routed, py::arg("router"), py::arg("h_ptr"), py::arg("tokens"),
           py::arg("k"), py::arg("out_ptr"), py::arg("normalize") = false,
           "forward with the softmax router's routing in the same call: router (a QMatrix [num_experts, hidden])"
           " logits of h, their float32 softmax, each token's k most probable experts best first (ties: the lower"
           " id), their probabilities as the weights; a token's result does not depend on the batch.");
}
