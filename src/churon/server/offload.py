"""Prompt work off the event loop: chat-template rendering, tokenization, grammar compilation.

Each costs milliseconds for an ordinary request, and seconds for a hostile one (a template that loops
until its own time limit, megabytes of text): on the event loop that would stall every client, /health
included. It runs on a pool of its own rather than the loop's default executor, which carries
AsyncLLMEngine's add_request: a burst of slow renderings must not keep admitted requests from starting.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from churon.tokenizer import ChatTemplateLimitError
from churon.tool_calls import ToolCallError, ToolPlan

T = TypeVar("T")

# Rendering and tokenizing hold the GIL for most of their time: more threads than this buy no speed,
# only more requests held at once by templates running to their time limit
PROMPT_THREADS = 4

_pool = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="churon-prompt")


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on the prompt pool; its exceptions are raised here, in the request's coroutine."""
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args, **kwargs))


async def build_plan(*args: Any, **kwargs: Any) -> ToolPlan:
    """ToolPlan.build (the chat template rendered and tokenized, the grammar compiled) on the prompt pool."""
    try:
        return await off_loop(ToolPlan.build, *args, **kwargs)
    except ToolCallError as e:
        if isinstance(e.__cause__, ChatTemplateLimitError):
            # the model's template, given this request's conversation, ran past its limits: this request's error
            raise ToolCallError(f"the model's chat template could not render this conversation within its limits"
                                f" ({e.__cause__}); shorten or change the conversation", e.param) from e.__cause__
        raise
