"""KV groups: which layers' keys and values share a block table, so that windowed layers can give memory back.

A layer with a sliding window of W positions only ever reads a sequence's last W keys, so the blocks behind them
can be freed as the sequence grows; a global layer needs all of them. Layers whose memory lives differently cannot
share one block table, so each kind gets tables of its own. As vLLM's hybrid allocator does, the layers are cut
into groups of one size (the fewest layers of any kind): a block id then names the same bytes in every group
(`group_size` layers' worth of one block), and all groups draw from one pool of blocks. Gemma 3 270M's 18 layers
(15 windowed, 3 global) make 6 groups of 3 layers: one global group, five windowed; gpt-oss's alternating layers
make two groups. A sequence holds one block table per group; a token costs a block slot in each group as long as
a window can see it.

The cache's storage is [group_size, num_blocks, block_size, kv_heads, head_dim]: layer i keeps its K/V at storage
index layer_slots[i][1], through group layer_slots[i][0]'s block table. A model without windowed layers (or a
layout made with `whole`) has one group of all its layers, the storage index being the layer: the plain layout.
A kind whose layer count the group size does not divide gets a last, smaller group whose unused storage index
costs memory (vLLM pads the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil

from churon.config import ModelConfig


@dataclass(frozen=True)
class KVGroup:
    window: int  # the positions its layers' attention sees (0: all): how many keys it must keep
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    group_size: int  # layers one block id spans in every group: the storage's first dimension
    layer_slots: tuple[tuple[int, int], ...] = field(init=False)  # per layer: (its group, its storage index)

    def __post_init__(self):
        slots = {layer: (g, i) for g, group in enumerate(self.groups) for i, layer in enumerate(group.layers)}
        object.__setattr__(self, "layer_slots", tuple(slots[layer] for layer in range(len(slots))))

    @classmethod
    def whole(cls, num_layers: int) -> "KVLayout":
        """Every layer in one group that keeps every key (a cache for one sequence, a model without windows)."""
        return cls((KVGroup(0, tuple(range(num_layers))),), num_layers)

    @classmethod
    def of(cls, config: ModelConfig) -> "KVLayout":
        """The model's layers grouped by window, so the windowed layers' blocks can be freed."""
        by_window: dict[int, list[int]] = {}
        for layer in range(config.num_layers):
            by_window.setdefault(config.window(layer), []).append(layer)
        if list(by_window) == [0]:
            return cls.whole(config.num_layers)
        size = min(len(layers) for layers in by_window.values())
        groups = [KVGroup(window, tuple(layers[i : i + size]))
                  for window, layers in sorted(by_window.items()) for i in range(0, len(layers), size)]
        return cls(tuple(groups), size)

    @property
    def windows(self) -> tuple[int, ...]:
        """Each group's window (0: keeps everything), in group order: what the block manager frees by."""
        return tuple(g.window for g in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)


def blocks_held(windows: tuple[int, ...], num_tokens: int, block_size: int, chunk: int = 1) -> int:
    """The most blocks one sequence of num_tokens tokens holds at once over KV groups with these windows,
    computing up to `chunk` tokens a step: a windowed group keeps the blocks its window sees behind the step's first
    token, and the step's own."""
    total = 0
    for window in windows:
        need = ceil(num_tokens / block_size)
        if window:  # the window's first key may sit anywhere in a block: one block more than it spans
            need = min(need, ceil((window - 1 + chunk) / block_size) + 1)
        total += need
    return total
