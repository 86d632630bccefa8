"""LoRA adapters applied unmerged, many at once: y = W x + s * B (A x) over the shared base weights.

Each of LoraSlots' slots holds one adapter (a request names its slot in its SequenceChunk). Per layer and
fused matrix (qkv, o, gate_up, down, the matrices LayerWeights holds), the adapters of all slots form one
stack the backend reads (Backend.lora_stack, Backend.add_lora). Slot s's pair there is its adapter's
modules on that matrix fused the way the weights are: A the parts' A stacked by rows [sum r, in], B
[out, sum r] block-diagonal, part p's rows by part p's columns = scale_p * B_p. Then B (A x) puts on each
part's rows exactly scale_p * B_p A_p x, what that module alone adds, in one pair of matmuls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from churon.config import ModelConfig
from churon.model.backend import Backend

if TYPE_CHECKING:
    from churon.formats.lora import LoraAdapter

# each fused matrix's parts, in the order of its rows (as LayerWeights.build stacks them)
FUSED_PARTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
MATRIX_OF_PART = {part: matrix for matrix, parts in FUSED_PARTS.items() for part in parts}


def part_rows(config: ModelConfig) -> dict[str, int]:
    """Each target module's output rows: its share of its fused matrix's rows."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": c.hidden_size,
            "mlp.gate_proj": c.intermediate_size, "mlp.up_proj": c.intermediate_size, "mlp.down_proj": c.hidden_size}


def fused_pair(adapter: LoraAdapter, config: ModelConfig, layer: int,
               matrix: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The adapter's (A [sum r, in], B [out, sum r]) on one fused matrix of one layer, the module scales in B;
    None when it has none of that matrix's modules. A part it leaves out gets no rows of A and zero rows of B."""
    rows = part_rows(config)
    parts = [(adapter.modules.get(f"layers.{layer}.{p}"), rows[p]) for p in FUSED_PARTS[matrix]]
    present = [m for m, _ in parts if m is not None]
    if not present:
        return None
    a = torch.cat([m.a.float() for m in present])
    b = torch.zeros(sum(n for _, n in parts), a.shape[0])
    row = col = 0
    for m, n in parts:
        if m is not None:
            r = m.a.shape[0]
            b[row : row + n, col : col + r] = m.scale * m.b.float()
            col += r
        row += n
    return a, b


class LoraSlots:
    """max_loras adapter slots over one model and its backend; per layer, the backend stacks of the fused
    matrices some loaded adapter touches (`layers[i]`: matrix name -> stack, what DecoderBlock applies)."""

    def __init__(self, config: ModelConfig, backend: Backend, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.config = config
        self.backend = backend
        self.adapters: list[LoraAdapter | None] = [None] * max_loras
        self.layers: list[dict[str, Any]] = [{} for _ in range(config.num_layers)]
        # each slot's fused pairs' bytes. The pairs themselves are not kept: the stacks hold them in their
        # backend's layout already, and a copy here would hold every fused B a second time (a qkv B is mostly
        # zeros), so a load or an unload fuses the other slots' pairs of the matrices it touches again
        self._slot_bytes = [0] * max_loras

    @property
    def max_loras(self) -> int:
        return len(self.adapters)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Put adapter in the free slot; raises ValueError for a slot out of range or taken, and the adapter's
        ModelFileError (naming the tensor) when it does not fit the model."""
        self._check_slot(slot)
        held = self.adapters[slot]
        if held is not None:
            raise ValueError(f"LoRA slot {slot} already holds the adapter {held.path}")
        adapter.check(self.config)
        self.adapters[slot] = adapter
        self._restack(slot, adapter)

    def unload(self, slot: int) -> None:
        """Free the slot; raises ValueError when it holds no adapter."""
        self._check_slot(slot)
        adapter = self.adapters[slot]
        if adapter is None:
            raise ValueError(f"LoRA slot {slot} holds no adapter")
        self.adapters[slot] = None
        self._restack(slot, adapter)

    def stack(self, layer: int, matrix: str) -> Any | None:
        """The backend stack of one layer's fused matrix ("qkv", "o", "gate_up", "down"); None when no loaded
        adapter touches it."""
        return self.layers[layer].get(matrix)

    @property
    def nbytes(self) -> int:
        """The fused pairs' float32 bytes over all slots (what the stacks hold)."""
        return sum(self._slot_bytes)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is out of range: this model has slots 0..{self.max_loras - 1}")

    def _restack(self, slot: int, adapter: LoraAdapter) -> None:
        """Rebuild the stack of every (layer, matrix) the adapter (just loaded or unloaded there) touches from
        each slot's fused pair: the other stacks keep the very objects they had."""
        touched = set()
        for name in adapter.modules:
            _, layer, part = name.split(".", 2)  # "layers.3.self_attn.q_proj"
            touched.add((int(layer), MATRIX_OF_PART[part]))
        nbytes = 0
        for layer, matrix in sorted(touched):
            pairs = [None if held is None else fused_pair(held, self.config, layer, matrix) for held in self.adapters]
            if pairs[slot] is not None:
                nbytes += sum(t.nbytes for t in pairs[slot])
            if any(p is not None for p in pairs):
                self.layers[layer][matrix] = self.backend.lora_stack(pairs)
            else:
                del self.layers[layer][matrix]
        self._slot_bytes[slot] = nbytes
