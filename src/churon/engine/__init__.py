"""The serving core: requests in, deltas out, over a paged KV cache (see core.py for the step).

    LLMEngine       one step at a time: schedule -> execute -> update -> output
    AsyncLLMEngine  the same for asyncio callers, stepped on a thread of its own
"""

from churon.engine.async_engine import AsyncLLMEngine
from churon.engine.core import LLMEngine
from churon.engine.output import CompletionOutput, Delta, EngineStats, Metrics, TokenLogprob

__all__ = ["LLMEngine", "AsyncLLMEngine", "CompletionOutput", "Delta", "EngineStats", "Metrics", "TokenLogprob"]
