"""Memory planner: weights + KV cache + activation buffers against the memory there is, before any allocation.

When the plan does not fit it says what does ("fits 8k context for 6 sequences, or 32k
for 1") instead of running out of memory halfway through a request.

A model with windowed layers (model/kv_layout.py) is planned by its KV groups: a block id holds group_size
layers' K/V, and a sequence of n tokens holds a block per block_size tokens in each global group but at most its
window's worth in each windowed group, so long contexts cost what the global layers keep plus a bounded rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from churon.config import EngineConfig, ModelConfig
from churon.engine.kv_cache import kv_bytes_per_token
from churon.model.kv_layout import KVLayout, blocks_held
from churon.errors import ChuronError

FP32 = 4


class MemoryPlanError(ChuronError):
    """The model and its KV cache do not fit the memory available."""


@dataclass
class MemoryPlan:
    weight_bytes: int
    activation_bytes: int
    block_bytes: int  # one block id's K/V: block_size tokens of the layout's group_size layers
    block_size: int
    num_blocks: int
    available_bytes: int
    layout: KVLayout
    chunk: int  # the most tokens a step computes for one sequence (max_num_batched_tokens): what a prefill holds more

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def kv_tokens(self) -> int:
        """Token slots in the pool: with one KV group, the tokens it holds."""
        return self.num_blocks * self.block_size

    def sequence_slots(self, context: int, chunk: int = 1) -> int:
        """The pool's token slots one sequence of `context` tokens holds over all groups, computing `chunk` tokens a
        step (1: decoding; a windowed group holds more during a prefill chunk)."""
        return blocks_held(self.layout.windows, context, self.block_size, chunk) * self.block_size

    @property
    def longest_sequence(self) -> int:
        """The most tokens one sequence alone can hold (unbounded, 2**62, where every layer is windowed)."""
        lo, hi = 0, 1 << 62
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.sequence_slots(mid, self.chunk) <= self.kv_tokens else (lo, mid - 1)
        return lo

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.kv_bytes

    def describe(self, context_length: int) -> str:
        return (
            f"weights {_gib(self.weight_bytes)} + activations {_gib(self.activation_bytes)} + KV cache {_gib(self.kv_bytes)}"
            f" ({self.num_blocks} blocks of {self.block_size} tokens) = {_gib(self.total_bytes)}"
            f" of {_gib(self.available_bytes)} available; the KV cache"
            f" {what_fits(self.kv_tokens, context_length, self.sequence_slots)}"
        )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def available_memory() -> int:
    """Memory the process can still use: MemAvailable, or the cgroup limit when that is lower."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                available = min(available, int(limit) - int(f.read()))
    except (OSError, ValueError):
        pass
    return available


def activation_bytes(config: ModelConfig, engine: EngineConfig) -> int:
    """Peak working buffers of one step: the token budget's hidden states and the sampled logits."""
    c = config
    per_token = 4 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 3 * c.intermediate_size
    return FP32 * (engine.max_num_batched_tokens * per_token + engine.max_num_seqs * c.vocab_size)


def what_fits(tokens: int, context_length: int, cost: Callable[[int], int] = lambda ctx: ctx) -> str:
    """'fits 8k context for 6 sequences, or 32k for 1' for a cache of `tokens` token slots, where a sequence of ctx
    tokens takes cost(ctx) of them (ctx itself without windowed layers)."""
    options = []
    for ctx in sorted({2048, 8192, 32768, context_length}):
        n = tokens // cost(ctx)
        if ctx <= context_length and n >= 1:
            options.append(f"{ctx // 1024}k context for {n} sequence{'s' if n > 1 else ''}"
                           if ctx % 1024 == 0 else f"{ctx} tokens of context for {n}")
    if not options:
        return f"fits {tokens} tokens in all (less than one 2k context)"
    return "fits " + ", or ".join(options)


def plan_memory(
    config: ModelConfig,
    weight_bytes: int,
    engine: EngineConfig,
    context_length: int,
    kv_dtype: torch.dtype,
    available: int | None = None,
) -> MemoryPlan:
    available = available_memory() if available is None else available
    layout = KVLayout.of(config)
    block = engine.block_size * kv_bytes_per_token(config, kv_dtype, layout.group_size)
    act = activation_bytes(config, engine)
    free_for_kv = available - weight_bytes - act

    def cost(ctx: int, chunk: int = 1) -> int:  # token slots of one sequence of ctx tokens (MemoryPlan.sequence_slots)
        return blocks_held(layout.windows, ctx, engine.block_size, chunk) * engine.block_size

    if free_for_kv < block:
        raise MemoryPlanError(
            f"the model does not fit: weights {_gib(weight_bytes)} + activations {_gib(act)}"
            f" leave no room for a KV cache in {_gib(available)} available; lower max_num_batched_tokens or use a smaller model"
        )
    if engine.kv_cache_memory is not None:
        if engine.kv_cache_memory > free_for_kv:
            raise MemoryPlanError(
                f"kv_cache_memory={engine.kv_cache_memory} bytes does not fit: weights {_gib(weight_bytes)} + activations"
                f" {_gib(act)} leave {_gib(free_for_kv)} of {_gib(available)}; that much KV cache"
                f" {what_fits(free_for_kv // block * engine.block_size, context_length, cost)}"
            )
        budget = engine.kv_cache_memory
    else:
        budget = int(engine.kv_cache_fraction * free_for_kv)
    # no use holding more than max_num_seqs full contexts
    wanted_blocks = engine.max_num_seqs * cost(context_length, engine.max_num_batched_tokens) // engine.block_size
    num_blocks = min(budget // block, wanted_blocks)
    if num_blocks < 1:
        raise MemoryPlanError(f"kv_cache_memory={budget} bytes is less than one KV block ({block} bytes)")
    return MemoryPlan(weight_bytes, act, block, engine.block_size, num_blocks, available, layout,
                      engine.max_num_batched_tokens)


def plan_share(
    config: ModelConfig,
    weight_bytes: int,
    engine: EngineConfig,
    context_length: int,
    kv_dtype: torch.dtype,
    share: int,
) -> MemoryPlan:
    """The plan of one of a server's models, made before it loads: what it will hold once loaded with
    kv_cache_memory=plan.kv_bytes. Its KV cache is engine.kv_cache_memory when set, else what the weights and
    activations leave of `share` (the server's budget over the models it keeps loaded) but at least one full
    context (a model larger than its share still takes requests), and never more than max_num_seqs full
    contexts (as plan_memory). Unlike plan_memory it does not look at the memory free now: the server weighs
    the total against its own budget, unloading idle models to make room."""
    layout = KVLayout.of(config)
    act = activation_bytes(config, engine)
    block = engine.block_size * kv_bytes_per_token(config, kv_dtype, layout.group_size)
    one_context = blocks_held(layout.windows, context_length, engine.block_size, engine.max_num_batched_tokens)
    wanted = engine.max_num_seqs * one_context
    if engine.kv_cache_memory is not None:
        num_blocks = engine.kv_cache_memory // block
        if num_blocks < 1:
            raise MemoryPlanError(f"kv_cache_memory={engine.kv_cache_memory} bytes is less than one KV block ({block} bytes)")
    else:
        num_blocks = max(one_context, (share - weight_bytes - act) // block)
    return MemoryPlan(weight_bytes, act, block, engine.block_size, min(num_blocks, wanted), share, layout,
                      engine.max_num_batched_tokens)
