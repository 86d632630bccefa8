"""NativeBackend: the backend's operations on churon._cpu: quantized matmuls on 8-bit activations,
fused row ops, block-table attention; float32 activations.

Each token's row is computed the same way whatever else is in the batch: the matmuls split work by
output rows with a fixed reduction order, and attention treats every query token on its own.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType

from churon import kernels
from churon.kernels import ops
from churon.kernels.heap import keep_freed_memory
from churon.formats.gguf import GGUFTensor
from churon.formats.quants import mxfp4_as_q8_0
from churon.config import ModelConfig
from churon.formats.source import ModelSource
from churon.model.backend import Experts, KVCache, RopeTables
from churon.model.batch import ForwardBatch
from churon.model.kv_layout import KVLayout
from churon.model.weights import RawWeight, RowStack, dense, is_float, quantized


def _narrowest_float(t: torch.Tensor) -> tuple[torch.Tensor, GGMLQuantizationType]:
    """A float32 matrix as bfloat16 or float16 when every value is one (a Hugging Face checkpoint in bf16 or fp16
    reaches the backend as float32): the same values in half the bytes, so a memory-bound decode reads half as
    much, and the float kernels widen each weight back to float32 exactly, so every result is the same bits."""
    for dtype, qtype in ((torch.bfloat16, GGMLQuantizationType.BF16), (torch.float16, GGMLQuantizationType.F16)):
        narrow = t.to(dtype)
        if torch.equal(narrow.float(), t):
            return narrow, qtype
    return t, GGMLQuantizationType.F32


# the smallest output matrix given a coarse copy (NativeBackend.prepare_argmax): below it the matrix tends to stay in
# cache between steps, where the copy's extra bytes and unpacking cost more than they save (SmolLM2's 30 MB: greedy
# decoding 285 -> 260 tok/s; Gemma 3's 178 MB: 76 -> 82 tok/s; 2 threads, AMX Xeon with a 480 MB L3)
COARSE_ARGMAX_BYTES = 64 << 20


def coarse_copy_bytes(source: ModelSource) -> int:
    """What generating with this model file on the native backend adds to its weights' memory: the coarse copy
    of a Q8_0 output matrix of COARSE_ARGMAX_BYTES or more (cpu.coarse_unit_bytes for each 16 rows, the last group
    padded, by 32 columns; only where the ISA chosen now has its kernel, AVX-512). 0 for other files and ISAs."""
    c = source.config
    if not isinstance(c, ModelConfig) or c.final_logit_softcap:
        return 0
    if kernels.cpu is None or not kernels.cpu.coarse_argmax():  # no kernel to read a copy: none is built
        return 0
    name = "token_embd.weight" if c.tie_word_embeddings else "output.weight"
    out = next((t for t in source.tensors if t.name == name), None)
    if out is None or out.dtype != "Q8_0" or out.n_bytes < COARSE_ARGMAX_BYTES or len(out.shape) != 2:
        return 0  # (a matrix of another shape is the loader's error to give)
    rows, cols = out.shape
    return -(-rows // 16) * (cols // 32) * kernels.cpu.coarse_unit_bytes


class NativeBackend:
    """churon._cpu kernels; every tensor float32 and contiguous."""

    name = "native"
    dtype = torch.float32
    # float32: float16 or bfloat16 caches halve attention's memory traffic and score the same on
    # plain text (GPL-3 mean KL from the fp32 path 0.002247 / 0.002300 vs 0.002255), but after a
    # chat template they move SmolLM2's first-token logit gaps by 0.2-0.35, enough to change
    # the answer to "What is the capital of France?"; kv_dtype="float16" is there to choose
    kv_dtype = torch.float32
    # types the native matmul reads directly; others are dequantized to F32 first
    NATIVE_TYPES = {
        GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
    }

    def __init__(self):
        if kernels.cpu is None:
            raise RuntimeError(kernels.reason)
        self.cpu = kernels.cpu
        keep_freed_memory()  # op-by-op forwards free and allocate megabytes an op (kernels/heap.py)

    def matrix(self, w: RawWeight):
        if isinstance(w, RowStack):  # each part on its stored bytes, run as one matrix
            return self.cpu.QMatrixStack([self.matrix(p) for p in w.parts])
        if isinstance(w, GGUFTensor) and w.qtype == GGMLQuantizationType.MXFP4:
            # gpt-oss's experts: as Q8_0 blocks of the same values when every scale fits an fp16, else float32
            q8 = mxfp4_as_q8_0(w.data)
            if q8 is not None:
                w = GGUFTensor(w.name, w.shape, GGMLQuantizationType.Q8_0, q8)
        if isinstance(w, GGUFTensor) and w.qtype in self.NATIVE_TYPES:
            raw, qtype, (rows, cols) = w.data, w.qtype, w.shape
        else:
            t, qtype = _narrowest_float(dense(w).contiguous())
            raw, (rows, cols) = t.view(torch.uint8).numpy().reshape(-1), t.shape
        return self.cpu.QMatrix(np.ascontiguousarray(raw), int(qtype), int(rows), int(cols))

    @property
    def bf16_tiles(self) -> bool:
        """whether an encoder's float weights and its attention run on the AMX-BF16 tiles (encoder_matrix)"""
        return self.cpu.bf16_tiles_available()

    def encoder_matrix(self, w: RawWeight):
        """An encoder's matmul weight. Float weights run on the AMX-BF16 tiles where this CPU has them (and the amx
        ISA is chosen): x and W rounded to bfloat16, the products summed in float32, at 2-3x the 8-bit matmul's rate
        on all-MiniLM-L6-v2's shapes; elsewhere as Q8_0 blocks quantized at load, whose 8-bit products VNNI runs at
        about three times the float32 matmul's rate. Quantized GGUF weights run as stored. Either way a row's result
        does not depend on the other rows of the call."""
        if is_float(w):
            if self.bf16_tiles:
                t = dense(w).float().contiguous()
                return self.cpu.Bf16TileMatrix(t.numpy(), t.shape[0], t.shape[1])
            w = quantized(w, GGMLQuantizationType.Q8_0, getattr(w, "name", "encoder weight"))
        return self.matrix(w)

    def vector(self, w: RawWeight) -> torch.Tensor:
        return dense(w).contiguous()

    def embedding(self, table, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(ids.shape[0], table.cols)
        table.dequantize_rows(ids.data_ptr(), ids.shape[0], out.data_ptr())
        return out

    def linear(self, w, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.rows)
        w.matmul(x.data_ptr(), y.data_ptr(), x.shape[0], bias.data_ptr() if bias is not None else 0)
        return y

    def linear_precise(self, w, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with activations at about 16 bits instead of 8, for the same weight traffic.

        The kernel splits x = hi + lo, hi its 8-bit block quantization and lo the rounding error
        quantized in turn at a 127x finer scale, and runs both against each weight block. Used
        for the logits, where 8-bit activations cost the most accuracy (KL from the fp32 path on
        GPL-3: 0.0029 -> 0.0023, below llama.cpp's 0.0030).
        """
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.rows)
        w.matmul(x.data_ptr(), y.data_ptr(), x.shape[0], 0, True)
        return y

    def linear_argmax(self, w, x: torch.Tensor) -> torch.Tensor:
        """linear_precise's values where one may be its row's maximum, less precise ones where they are sure to be
        below it (Q8_0): from 2 rows the 16-bit activations' lo part runs only against the weight rows that may win;
        one row reads prepare_argmax's coarse copy, then the precise product of the rows that may win"""
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.rows)
        w.matmul_argmax(x.data_ptr(), y.data_ptr(), x.shape[0])
        return y

    def prepare_argmax(self, w) -> None:
        """A large Q8_0 logits matrix gets its 6-bit coarse copy (where the ISA has its kernel): one greedy row's
        logits read ~3/4 of its bytes, for ~3/4 more memory."""
        if isinstance(w, self.cpu.QMatrix) and w.nbytes >= COARSE_ARGMAX_BYTES:
            w.prepare_argmax()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        n = x.shape[-1]
        out = torch.empty_like(x)
        self.cpu.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps)
        return out

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     x_norm: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[-1]
        out = torch.empty_like(x)
        self.cpu.add_rms_norm(residual.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps,
                              x_norm.data_ptr() if x_norm is not None else 0)
        return out

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        n = x.shape[-1]
        out = torch.empty_like(x)
        self.cpu.layer_norm(x.data_ptr(), 0, weight.data_ptr(), bias.data_ptr(), out.data_ptr(), x.numel() // n, n, eps)
        return out

    def add_layer_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> torch.Tensor:
        """layer_norm(residual + x) as a new tensor, in one pass; residual and x are left as they are."""
        residual, x = residual.contiguous(), x.contiguous()
        n = x.shape[-1]
        out = torch.empty_like(x)
        self.cpu.layer_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(),
                            x.numel() // n, n, eps)
        return out

    def gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        self.cpu.gelu(x.data_ptr(), out.data_ptr(), x.numel(), approximate)
        return out

    def gelu_mlp(self, x: torch.Tensor, up, up_bias: torch.Tensor, down, down_bias: torch.Tensor,
                 approximate: str = "none") -> torch.Tensor:
        """On the AMX-BF16 tiles in one kernel (Bf16TileMatrix.gelu_mlp): the activation, which the down projection
        rounds to bfloat16, through a GELU within 5e-7 of the exact one, never written out; a quarter less time than
        op by op on all-MiniLM-L6-v2's shapes. Other weights op by op."""
        if isinstance(up, self.cpu.Bf16TileMatrix) and isinstance(down, self.cpu.Bf16TileMatrix):
            x = x.contiguous()
            y = torch.empty(x.shape[0], down.rows)
            up.gelu_mlp(down, x.data_ptr(), y.data_ptr(), x.shape[0], up_bias.data_ptr(), down_bias.data_ptr(),
                        approximate)
            return y
        return self.linear(down, self.gelu(self.linear(up, x, up_bias), approximate), down_bias)

    def attention_packed(self, qkv: torch.Tensor, heads: int, head_dim: int, seq_starts: torch.Tensor,
                         scale: float, bf16_tiles: bool = False) -> torch.Tensor:
        """Every row over its own sequence's rows (q, k, v read in place from qkv's columns), bitwise the same
        whatever else is packed with it and whatever the thread count; bf16_tiles: on the AMX-BF16 tiles."""
        return ops.attention_packed(qkv, heads, head_dim, seq_starts, scale, bf16_tiles=bf16_tiles)

    def rope_and_cache(self, qkv: torch.Tensor, shape: tuple[int, int, int], batch: ForwardBatch, cos: torch.Tensor,
                       sin: torch.Tensor, cache: KVCache, layer: int,
                       head_norms: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0) -> torch.Tensor:
        """One kernel: the heads' norms and RoPE on q and k in place in qkv, k and v stored at their slots. Returns q
        (a view of qkv)."""
        heads, kv_heads, head_dim = shape
        n = qkv.shape[0]
        norms = (head_norms[0].data_ptr(), head_norms[1].data_ptr()) if head_norms is not None else (0, 0)
        self.cpu.rope_and_cache(
            qkv.data_ptr(), n, heads, kv_heads, head_dim, batch.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            cache.k[layer].data_ptr(), cache.v[layer].data_ptr(), batch.slot_mapping.data_ptr(), qkv.stride(0),
            cache.dtype_name, *_scale_ptrs(cache, layer), *norms, eps,
        )
        return qkv[:, : heads * head_dim].view(n, heads, head_dim)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        n = gate_up.shape[-1] // 2
        out = torch.empty(gate_up.shape[0], n)
        self.cpu.swiglu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], n)
        return out

    def experts(self, gate_up: list[RawWeight], down: list[RawWeight]) -> Experts:
        # MoeExperts runs one QMatrix an expert: a gate and up of two types go as one float32 matrix
        gate_up = [self.matrix(dense(w) if isinstance(w, RowStack) else w) for w in gate_up]
        down = [self.matrix(w) for w in down]
        return Experts(gate_up, down, kernel=self.cpu.MoeExperts(gate_up, down))

    def moe_experts(self, experts: Experts, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                    normalize: bool = False) -> torch.Tensor:
        """One call for all the experts (churon._cpu.MoeExperts): the tokens grouped by expert, each token's row
        quantized once, every phase's work over all experts in one parallel dispatch, the renormalization in the
        same call; bitwise what experts_one_by_one gives on this backend."""
        return ops.moe_experts(experts.kernel, h.contiguous(), chosen.contiguous(), weights.contiguous(), normalize)

    def routed_experts(self, router, experts: Experts, h: torch.Tensor, k: int, normalize: bool = False) -> torch.Tensor:
        """Routing and experts in one call (churon._cpu.MoeExperts.forward_routed): the router's matmul, its
        softmax and top k in C++, then what moe_experts runs; the softmax's exps are std::exp's, within an ulp or so
        of torch's."""
        return ops.routed_experts(experts.kernel, router, h.contiguous(), k, normalize)

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        n = gate_up.shape[-1] // 2
        out = torch.empty(gate_up.shape[0], n)
        self.cpu.geglu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], n)
        return out

    def swiglu_clamped(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's SwiGLU through the swiglu kernel: silu(alpha * g) * (u + 1) / alpha = (u + 1) * g * sigmoid(alpha
        * g), g and u clamped first. The clamps, products and quotient are torch's elementwise ops, exact (correctly
        rounded) on their vector and scalar paths alike, so a row's bits do not depend on the batch."""
        n = gate_up.shape[-1] // 2
        gate_up = gate_up.contiguous()  # the matmul's own output: changed in place
        gate_up[:, :n].clamp_(max=limit).mul_(alpha)
        gate_up[:, n:].clamp_(min=-limit, max=limit).add_(1).div_(alpha)
        return self.swiglu(gate_up)

    def attention(self, q: torch.Tensor, cache: KVCache, layer: int, batch: ForwardBatch, scale: float,
                  window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Every query token attends on its own (its keys up to its position, through its sequence's block table).

        window > 0: only its last `window` keys (blocks wholly before them are not read); softcap > 0: scores
        s -> softcap * tanh(s / softcap); sinks float32 [heads], contiguous: per head a logit in the softmax's
        denominator only."""
        m, heads, head_dim = q.shape
        out = torch.empty(m, heads, head_dim)
        tables = batch.token_block_tables
        self.cpu.attention_decode(
            q.data_ptr(), cache.k[layer].data_ptr(), cache.v[layer].data_ptr(), tables.data_ptr(),
            batch.token_context_lens.data_ptr(), out.data_ptr(), m, heads, cache.k.shape[3], head_dim,
            cache.block_size, scale, tables.shape[1], q.stride(0), cache.dtype_name, *_scale_ptrs(cache, layer),
            window, softcap, sinks.data_ptr() if sinks is not None else 0,
        )
        return out

    def decoder_stack(self, config: ModelConfig, layers: Sequence[Any], embed, norm: torch.Tensor, rope: RopeTables,
                      attention_scale: float) -> "DecoderStack | None":
        """The layer stack as one native call, for every family but those whose MLP has torch in it: gpt-oss's
        routing and clamped experts, Qwen2-MoE's gated shared expert."""
        if any(layer.router is not None and (layer.router_bias is not None or layer.shared_gate_up is not None)
               for layer in layers) or config.expert_form != "swiglu" or config.router_topk_first:
            return None
        return DecoderStack(self.cpu, config, layers, embed, norm, rope, attention_scale)

    def lora_stack(self, pairs) -> ops.LoraStack:
        """Per slot A [R, in] and B's transpose [R, out], float32, as the lora_add kernel reads them."""
        return ops.LoraStack(pairs)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, stack: ops.LoraStack, slots: torch.Tensor,
                 scales: torch.Tensor) -> None:
        """y[t] += B_s @ (scales[t] * (A_s @ x[t])) in place, the step's tokens grouped by adapter; a token's
        bits depend only on its own row, slot and scale (not on the batch, its position or the thread count)."""
        ops.lora_add(y, x, stack, slots, scales)


def _scale_ptrs(cache: KVCache, layer: int) -> tuple[int, int]:
    """Addresses of an int8 cache's K and V scales of one layer (0 for float caches)."""
    if cache.k_scale is None:
        return 0, 0
    return cache.k_scale[layer].data_ptr(), cache.v_scale[layer].data_ptr()


class DecoderStack:
    """A decoder's layers in one native call (churon._cpu.DecoderStack): Python touches a step once instead of
    ~10 times a layer. The call runs the per-op path's own kernels in DecoderBlock's order, so its hidden states
    are bitwise that path's (tests/test_decoder_stack.py)."""

    def __init__(self, cpu, config: ModelConfig, layers: Sequence[Any], embed, norm: torch.Tensor, rope: RopeTables,
                 attention_scale: float):
        self.hidden = config.hidden_size
        # the C++ object borrows these vectors and tables: held here for its lifetime
        self._held = (layers, norm, rope)
        self.stack = cpu.DecoderStack(
            embed, norm.data_ptr(), config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps,
            attention_scale, attn_softcap=config.attn_logit_softcap,
            embed_scale=config.hidden_size**0.5 if config.scale_embeddings else 0.0,
            gelu_tanh=config.hidden_act == "gelu_tanh", head_norms=config.qk_norm_per_head,
            moe_k=config.num_experts_per_tok if config.num_experts else 0, moe_normalize=config.norm_topk_prob,
        )
        for layer in layers:
            cos, sin = (rope.local_cos, rope.local_sin) if layer.window else (rope.cos, rope.sin)
            moe = layer.router is not None
            self.stack.add_layer(
                layer.qkv, layer.o, layer.gate_up, layer.down, layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                cos.data_ptr(), sin.data_ptr(), window=layer.window, attn_out_norm_ptr=_ptr(layer.attn_out_norm),
                mlp_out_norm_ptr=_ptr(layer.mlp_out_norm), qkv_bias_ptr=_ptr(layer.qkv_bias), o_bias_ptr=_ptr(layer.o_bias),
                sinks_ptr=_ptr(layer.sinks), q_norm_ptr=_ptr(layer.q_norm), k_norm_ptr=_ptr(layer.k_norm),
                experts=layer.experts.kernel if moe else None, router=layer.router if moe else None,
            )
        self._layer_slots: dict[KVLayout, torch.Tensor] = {}

    def hidden_states(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        slots = self._layer_slots.get(cache.layout)
        if slots is None:
            slots = self._layer_slots[cache.layout] = torch.tensor(cache.layout.layer_slots, dtype=torch.int64)
        rows = batch.logits_indices
        out = torch.empty(rows.shape[0], self.hidden)
        k_scale, v_scale = cache.k_scale, cache.v_scale
        tables = batch.kv_token_tables
        self.stack.forward(
            batch.input_ids.data_ptr(), batch.positions.data_ptr(), batch.num_tokens, cache.k.data_ptr(),
            cache.v.data_ptr(), _ptr(k_scale), _ptr(v_scale), cache.k.stride(0) * cache.k.element_size(),
            k_scale.stride(0) * 4 if k_scale is not None else 0, cache.dtype_name, cache.block_size, slots.data_ptr(),
            batch.kv_slot_mappings.data_ptr(), tables.data_ptr(), tables.shape[2], batch.token_context_lens.data_ptr(),
            rows.data_ptr(), rows.shape[0], out.data_ptr(),
        )
        return out


def _ptr(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0
