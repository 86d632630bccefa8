"""Memory planner: weights + KV cache + activation buffers against the memory there is, before any allocation.

When the plan does not fit it says what does ("fits 8k context for 6 sequences, or 32k
for 1") instead of running out of memory halfway through a request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from churon.config import EngineConfig, ModelConfig
from churon.engine.kv_cache import kv_bytes_per_token
from churon.errors import ChuronError

FP32 = 4


class MemoryPlanError(ChuronError):
    """The model and its KV cache do not fit the memory available."""


@dataclass
class MemoryPlan:
    weight_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    available_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.kv_bytes

    def describe(self, context_length: int) -> str:
        return (
            f"weights {_gib(self.weight_bytes)} + activations {_gib(self.activation_bytes)} + KV cache {_gib(self.kv_bytes)}"
            f" ({self.num_blocks} blocks of {self.block_size} tokens) = {_gib(self.total_bytes)}"
            f" of {_gib(self.available_bytes)} available; the KV cache {what_fits(self.kv_tokens, context_length)}"
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


def what_fits(tokens: int, context_length: int) -> str:
    """'fits 8k context for 6 sequences, or 32k for 1' for a cache of `tokens` tokens."""
    options = []
    for ctx in sorted({2048, 8192, 32768, context_length}):
        if ctx <= context_length and tokens >= ctx:
            options.append(f"{ctx // 1024}k context for {tokens // ctx} sequence{'s' if tokens // ctx > 1 else ''}"
                           if ctx % 1024 == 0 else f"{ctx} tokens of context for {tokens // ctx}")
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
    kv_per_token = kv_bytes_per_token(config, kv_dtype)
    act = activation_bytes(config, engine)
    free_for_kv = available - weight_bytes - act
    block = engine.block_size * kv_per_token
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
                f" {what_fits(free_for_kv // kv_per_token, context_length)}"
            )
        budget = engine.kv_cache_memory
    else:
        budget = int(engine.kv_cache_fraction * free_for_kv)
    # no use holding more than max_num_seqs full contexts
    wanted_blocks = -(-engine.max_num_seqs * context_length // engine.block_size)
    num_blocks = min(budget // block, wanted_blocks)
    if num_blocks < 1:
        raise MemoryPlanError(f"kv_cache_memory={budget} bytes is less than one KV block ({block} bytes)")
    return MemoryPlan(weight_bytes, act, kv_per_token, engine.block_size, num_blocks, available)


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
    kv_per_token = kv_bytes_per_token(config, kv_dtype)
    act = activation_bytes(config, engine)
    block = engine.block_size * kv_per_token
    one_context = -(-context_length // engine.block_size)
    wanted = -(-engine.max_num_seqs * context_length // engine.block_size)
    if engine.kv_cache_memory is not None:
        num_blocks = engine.kv_cache_memory // block
        if num_blocks < 1:
            raise MemoryPlanError(f"kv_cache_memory={engine.kv_cache_memory} bytes is less than one KV block ({block} bytes)")
    else:
        num_blocks = max(one_context, (share - weight_bytes - act) // block)
    return MemoryPlan(weight_bytes, act, kv_per_token, engine.block_size, min(num_blocks, wanted), share)
