// churon._cpu: the Python bindings (pybind11) of the native CPU kernels.
//
// Kernels take raw addresses (Python ints from tensor.data_ptr()) so that the module never
// links against libtorch. The GIL stays held during a call: calls are short, and releasing it
// would let another Python thread take it and delay our return by up to the switch interval.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "decoder.h"
#include "isa.h"
#include "ops.h"
#include "qmatrix.h"
#include "tile_matrix.h"
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

// a layer's matrix from Python: a QMatrix, a QMatrixStack, or None (an MoE layer's MLP)
Linear linear_of(const py::object& w, const char* what) {
  Linear l;
  if (w.is_none()) return l;
  if (py::isinstance<QMatrix>(w))
    l.matrix = w.cast<QMatrix*>();
  else if (py::isinstance<QMatrixStack>(w))
    l.stack = w.cast<const QMatrixStack*>();
  else
    throw std::invalid_argument(std::string("DecoderStack.add_layer: ") + what + " must be a QMatrix or a QMatrixStack");
  return l;
}

template <class T>
const T* maybe(uintptr_t p) { return reinterpret_cast<const T*>(p); }

}  // namespace
}  // namespace churon

PYBIND11_MODULE(_cpu, m) {
  using namespace churon;
  m.doc() = "churon native CPU kernels (see src/churon/kernels/cpu/common.h for layouts)";
  m.attr("isa_error") = init_isa();  // non-empty when CHURON_ISA named an ISA that cannot run
  m.attr("coarse_unit_bytes") = kCoarseUnitBytes;  // prepare_argmax's copy: bytes a 16-row group x 32 columns

  m.def("isa", [] { return std::string(kt()->name); }, "The ISA whose kernels run now.");
  m.def("available_isas", &available_isas, "ISAs compiled in and supported by this CPU, best first.");
  m.def("prefetch_weights_ahead", &prefetch_weights_ahead,
        "Whether quantized matmuls prefetch their weights 8 KiB ahead at every row count (Intel CPUs).");
  m.def("coarse_argmax", [] { return kt()->gemm_coarse != nullptr; },
        "Whether the ISA chosen now has the coarse kernel QMatrix.prepare_argmax builds a copy for (AVX-512).");
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
        py::arg("row_stride") = 0, py::arg("bf16_tiles") = false,
        "Bidirectional attention over sequences packed back to back: qkv float32 rows [tokens] row_stride"
        " floats apart (0: 3 * heads * head_dim) holding q, k, v in columns [0, H), [H, 2H), [2H, 3H), H ="
        " heads * head_dim; seq_starts int64 [n_seqs + 1] (0, len0, len0 + len1, ..., tokens); out float32"
        " [tokens, H]. Each row's result is the same whatever else is packed with it and whatever the"
        " thread count. bf16_tiles: on the AMX-BF16 tiles (bf16_tiles_available(); head_dim 32 or 64), q, k,"
        " v and the softmax weights rounded to bfloat16.");
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
      .def("matmul_argmax", &QMatrix::matmul_argmax, py::arg("x_ptr"), py::arg("y_ptr"), py::arg("m"),
           "y[m, rows]: matmul(precise=True)'s values where one may be its row's maximum, less precise ones where"
           " they are sure to lie below it; each row's first maximum (greedy decoding's token) is the precise"
           " product's. Q8_0 weights from 2 rows: matmul(precise=False)'s values, the lo part only for the row groups"
           " that may hold the maximum; one row, after prepare_argmax: the coarse copy's values, the precise product"
           " only for those groups; otherwise the precise matmul.")
      .def("prepare_argmax", &QMatrix::prepare_argmax,
           "Builds the coarse copy (6 of each code's 8 bits, nbytes grows by ~3/4) from which matmul_argmax takes one"
           " row's values; True where it did (Q8_0 weights, an ISA with its kernel: AVX-512), False elsewhere.")
      .def("dequantize", &QMatrix::dequantize, py::arg("out_ptr"),
           "float32 [rows, cols], bitwise equal to churon.formats.quants.dequantize.")
      .def("dequantize_bf16", &QMatrix::dequantize_bf16, py::arg("out_ptr"),
           "bfloat16 [rows, cols] (round to nearest even).")
      .def("dequantize_rows", &QMatrix::dequantize_rows, py::arg("ids_ptr"), py::arg("n"), py::arg("out_ptr"),
           "out[n, cols] = the dequantized rows ids[n] (int64): an embedding lookup.");

  m.def("bf16_tiles_available", [] { return bf16_tiles() != nullptr; },
        "Whether a Bf16TileMatrix can be built: the ISA chosen now is amx, the CPU has AMX-BF16 tiles and"
        " Linux lets this process use them.");
  py::class_<Bf16TileMatrix>(m, "Bf16TileMatrix")
      .def(py::init([](py::buffer raw, int64_t rows, int64_t cols) {
             const py::buffer_info info = raw.request();
             if (info.format != py::format_descriptor<float>::format())
               throw std::invalid_argument("Bf16TileMatrix: the weights must be float32");
             return new Bf16TileMatrix(static_cast<const float*>(info.ptr), int64_t(info.size) * int64_t(info.itemsize),
                                       is_contiguous(info), rows, cols);
           }),
           py::arg("raw"), py::arg("rows"), py::arg("cols"),
           "A [rows, cols] float32 matrix rounded to bfloat16 and packed for the AMX-BF16 tiles.")
      .def_property_readonly("rows", &Bf16TileMatrix::rows)
      .def_property_readonly("cols", &Bf16TileMatrix::cols)
      .def_property_readonly("layout", &Bf16TileMatrix::layout)
      .def_property_readonly("nbytes", &Bf16TileMatrix::nbytes)
      .def("matmul", &Bf16TileMatrix::matmul, py::arg("x_ptr"), py::arg("y_ptr"), py::arg("m"), py::arg("bias_ptr") = 0,
           "y[m, rows] = bf16(x[m, cols]) @ bf16(W)^T (+ bias[rows]), the products summed in float32 on the"
           " tiles; float32, C-contiguous. A row's result is the same whatever m.")
      .def("gelu_mlp", &Bf16TileMatrix::gelu_mlp, py::arg("down"), py::arg("x_ptr"), py::arg("y_ptr"), py::arg("m"),
           py::arg("up_bias_ptr") = 0, py::arg("down_bias_ptr") = 0, py::arg("approximate") = "none",
           "y[m, down.rows] = gelu(x @ W^T + up_bias) @ down^T + down_bias, W this matrix (the up projection): each"
           " product as matmul's, gelu's output rounded to bfloat16 for the down projection (gelu within 5e-7;"
           " approximate 'none' (erf) or 'tanh'); 128 rows at a time in one pass. A row's result is the same"
           " whatever m.");

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

  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init([](QMatrix& embed, uintptr_t final_norm, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       double eps, double attn_scale, double attn_softcap, double embed_scale, bool gelu_tanh,
                       bool head_norms, int64_t moe_k, bool moe_normalize) {
             return new DecoderStack(embed, maybe<float>(final_norm), heads, kv_heads, head_dim, eps, attn_scale,
                                     attn_softcap, embed_scale, gelu_tanh, head_norms, moe_k, moe_normalize);
           }),
           py::arg("embed"), py::arg("final_norm_ptr"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("eps"), py::arg("attn_scale"), py::arg("attn_softcap") = 0.0, py::arg("embed_scale") = 0.0,
           py::arg("gelu_tanh") = false, py::arg("head_norms") = true, py::arg("moe_k") = 0,
           py::arg("moe_normalize") = false, py::keep_alive<1, 2>(),
           "A decoder's layer stack run as one call (forward): embed the token embeddings (a QMatrix), final_norm"
           " float32 [hidden]; embed_scale 0: none, else the embeddings times it (Gemma); gelu_tanh: GeGLU MLPs,"
           " else SwiGLU; head_norms: q/k norms per head (else over all of q and of k); moe_k, moe_normalize: the"
           " MoE layers' experts per token and their renormalization. Float32 vectors are borrowed: keep them alive.")
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def(
          "add_layer",
          [](DecoderStack& s, const py::object& qkv, const py::object& o, const py::object& gate_up,
             const py::object& down, uintptr_t input_norm, uintptr_t post_norm, uintptr_t cos, uintptr_t sin,
             int64_t window, uintptr_t attn_out_norm, uintptr_t mlp_out_norm, uintptr_t qkv_bias, uintptr_t o_bias,
             uintptr_t sinks, uintptr_t q_norm, uintptr_t k_norm, const MoeExperts* experts, QMatrix* router) {
            DecoderLayer l;
            l.qkv = linear_of(qkv, "qkv");
            l.o = linear_of(o, "o");
            l.gate_up = linear_of(gate_up, "gate_up");
            l.down = linear_of(down, "down");
            l.input_norm = maybe<float>(input_norm);
            l.post_norm = maybe<float>(post_norm);
            l.cos = maybe<float>(cos);
            l.sin = maybe<float>(sin);
            l.window = window;
            l.attn_out_norm = maybe<float>(attn_out_norm);
            l.mlp_out_norm = maybe<float>(mlp_out_norm);
            l.qkv_bias = maybe<float>(qkv_bias);
            l.o_bias = maybe<float>(o_bias);
            l.sinks = maybe<float>(sinks);
            l.q_norm = maybe<float>(q_norm);
            l.k_norm = maybe<float>(k_norm);
            l.experts = experts;
            l.router = router;
            s.add_layer(l);
          },
          py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm_ptr"),
          py::arg("post_norm_ptr"), py::arg("cos_ptr"), py::arg("sin_ptr"), py::arg("window") = 0,
          py::arg("attn_out_norm_ptr") = 0, py::arg("mlp_out_norm_ptr") = 0, py::arg("qkv_bias_ptr") = 0,
          py::arg("o_bias_ptr") = 0, py::arg("sinks_ptr") = 0, py::arg("q_norm_ptr") = 0, py::arg("k_norm_ptr") = 0,
          py::arg("experts") = nullptr, py::arg("router") = nullptr, py::keep_alive<1, 2>(), py::keep_alive<1, 3>(),
          py::keep_alive<1, 4>(), py::keep_alive<1, 5>(), py::keep_alive<1, 18>(), py::keep_alive<1, 19>(),
          "One more layer: its matrices (QMatrix or QMatrixStack; gate_up and down None on an MoE layer, which gives"
          " experts and router), the addresses of its float32 vectors (0: absent) and RoPE tables, its window.")
      .def(
          "forward",
          [](DecoderStack& s, uintptr_t ids, uintptr_t positions, int64_t tokens, uintptr_t k, uintptr_t v,
             uintptr_t k_scale, uintptr_t v_scale, int64_t layer_bytes, int64_t scale_layer_bytes,
             const std::string& kv_dtype, int64_t block_size, uintptr_t layer_slots, uintptr_t slot_mappings,
             uintptr_t token_tables, int64_t max_blocks, uintptr_t context_lens, uintptr_t rows, int64_t n_rows,
             uintptr_t out) {
            KvView kv;
            kv.k = k;
            kv.v = v;
            kv.k_scale = k_scale;
            kv.v_scale = v_scale;
            kv.layer_bytes = layer_bytes;
            kv.scale_layer_bytes = scale_layer_bytes;
            kv.dtype = kv_dtype;
            kv.block_size = block_size;
            kv.layer_slots = ptr<const int64_t>(layer_slots, "DecoderStack.forward: layer_slots");
            kv.slot_mappings = ptr<const int64_t>(slot_mappings, "DecoderStack.forward: slot_mappings");
            kv.token_tables = ptr<const int32_t>(token_tables, "DecoderStack.forward: token_tables");
            kv.max_blocks = max_blocks;
            kv.context_lens = ptr<const int32_t>(context_lens, "DecoderStack.forward: context_lens");
            // a step that returns no rows (a prefill chunk before the last) may pass empty tensors' 0 addresses
            s.forward(ptr<const int64_t>(ids, "DecoderStack.forward: ids"),
                      ptr<const int64_t>(positions, "DecoderStack.forward: positions"), tokens, kv,
                      n_rows ? ptr<const int64_t>(rows, "DecoderStack.forward: rows") : nullptr, n_rows,
                      n_rows ? ptr<float>(out, "DecoderStack.forward: out") : nullptr);
          },
          py::arg("ids_ptr"), py::arg("positions_ptr"), py::arg("tokens"), py::arg("k_ptr"), py::arg("v_ptr"),
          py::arg("k_scale_ptr"), py::arg("v_scale_ptr"), py::arg("layer_bytes"), py::arg("scale_layer_bytes"),
          py::arg("kv_dtype"), py::arg("block_size"), py::arg("layer_slots_ptr"), py::arg("slot_mappings_ptr"),
          py::arg("token_tables_ptr"), py::arg("max_blocks"), py::arg("context_lens_ptr"), py::arg("rows_ptr"),
          py::arg("n_rows"), py::arg("out_ptr"),
          "Every layer over one step: ids, positions int64 [tokens]; the KV cache k / v [group size, slots, kv"
          " heads, head dim] of kv_dtype (int8: scales k_scale / v_scale), layer_bytes (scale_layer_bytes) from one"
          " index of k (k_scale) to the next; layer_slots int64 [layers, 2]: each layer's KV group and index;"
          " slot_mappings int64 [groups, tokens], token_tables int32 [groups, tokens, max_blocks], context_lens int32"
          " [tokens]; out float32 [n_rows, hidden]: the final hidden states of the tokens rows (int64 [n_rows])"
          " names. Bitwise the per-op native path's.");
}
