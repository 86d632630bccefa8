"""AsyncLLMEngine: the LLMEngine for asyncio callers (the HTTP server).

One background thread drives engine.step() while there is work, so the event loop never
waits on the model; each request's deltas reach its coroutine through an asyncio.Queue.
A caller that stops listening (a client that disconnected) aborts its request, which frees
its KV blocks at once, or right after the step that is running.

A request that fails alone (finish_reason "error": NaN logits, its grammar, its detokenizer) raises
GenerationError in its own caller; only a step that fails as a whole (the model's forward raising)
fails every request, the waiting ones too: what a half-run step left in the engine is not known.

LoRA adapters load and unload while it serves: the adapter's file is read on a worker thread, outside
the lock, and only put into its slot under the lock, between two steps.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from typing import AsyncIterator, Sequence

from churon.engine.core import LLMEngine
from churon.engine.output import Delta, EngineStats
from churon.errors import GenerationError
from churon.formats.lora import read_lora
from churon.sampling import SamplingParams


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()  # guards the engine: add_request/abort from the loop, step from the thread
        self._work = threading.Condition(self._lock)
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending_aborts: deque[int] = deque()  # aborts asked for while a step held the lock
        # new requests waiting for the lock: the engine thread lets them in before its next step (a lock is not
        # fair: the thread that just released it takes it again first, and a request waited whole decode steps for
        # its turn, ~150 ms of its time to first token under 16 streams)
        self._adders = 0
        self._adders_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="churon-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> AsyncIterator[Delta]:
        """The request's deltas as they are produced; the last has finish_reason set.

        Bad input (an over-long prompt, bad token ids) raises here, before anything is queued; a request
        that fails while it generates raises GenerationError.
        """
        arrival = time.perf_counter()  # its time to first token counts from here, the wait for the lock included
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        # A step holds the lock for its whole length: wait for it on a worker thread, so the event
        # loop keeps streaming the other requests' tokens meanwhile.
        adding = loop.run_in_executor(None, self._add, prompt_ids, params, loop, queue, arrival)
        try:
            request_id = await asyncio.shield(adding)
        except asyncio.CancelledError:  # the caller left while the request was being queued: take it out again
            adding.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self.abort(f.result()))
            raise
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                if item.finish_reason == "error":
                    raise GenerationError(item.output.error)
                yield item
                if finished:
                    return
        finally:
            if not finished:  # cancelled, or the consumer stopped early
                self.abort(request_id)

    def _add(self, prompt_ids: Sequence[int], params: SamplingParams | None, loop: asyncio.AbstractEventLoop,
             queue: asyncio.Queue, arrival: float) -> int:
        with self._adders_lock:
            self._adders += 1
        try:
            with self._work:
                if self._closed:
                    raise RuntimeError("the engine is shut down")
                request_id = self.engine.add_request(prompt_ids, params, arrival)
                self._queues[request_id] = (loop, queue)
                return request_id
        finally:
            with self._adders_lock:
                self._adders -= 1
            with self._work:
                self._work.notify_all()

    def abort(self, request_id: int) -> None:
        """Stop a request and free its KV blocks: at once when no step is running, else as soon as
        the running step ends (the caller, often the event loop, never waits for a step)."""
        self._queues.pop(request_id, None)
        if self._lock.acquire(blocking=False):
            try:
                self.engine.abort(request_id)
            finally:
                self._lock.release()
        else:
            self._pending_aborts.append(request_id)  # the engine thread takes it before its next step

    async def add_lora(self, name: str, path: str | os.PathLike) -> None:
        """Load a LoRA adapter for requests to name (LLMEngine.add_lora's errors); the event loop goes on
        streaming meanwhile."""
        await asyncio.get_running_loop().run_in_executor(None, self._add_lora, name, path)

    def _add_lora(self, name: str, path: str | os.PathLike) -> None:
        engine = self.engine
        with self._lock:  # refused before a file is read for nothing
            engine.check_lora_name(name)
        adapter = read_lora(path, engine.model_config, engine.config.max_lora_rank)  # no step waits for the file
        with self._lock:
            engine.add_lora(name, adapter)

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter (LLMEngine.remove_lora): new requests can no longer name it, running ones finish with it."""
        await asyncio.get_running_loop().run_in_executor(None, self._remove_lora, name)

    def _remove_lora(self, name: str) -> None:
        with self._lock:
            self.engine.remove_lora(name)

    def lora_names(self) -> tuple[str, ...]:
        """The adapters requests can name now: a snapshot, without waiting for a running step."""
        return self.engine.lora_names()

    def stats(self) -> EngineStats:
        """A consistent snapshot of the engine's counters (for /metrics); waits for a running step."""
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        with self._work:
            self._closed = True
            self._work.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._work:
                while self._pending_aborts:
                    self.engine.abort(self._pending_aborts.popleft())
                while not self._closed and not self.engine.has_unfinished():
                    self._work.wait()
                # requests queuing for the lock go in first (bounded: a wait that is not woken ends in 50 ms)
                self._work.wait_for(lambda: self._adders == 0 or self._closed, timeout=0.05)
                if self._closed:
                    return
                try:
                    deltas = self.engine.step()
                    error = None
                except Exception as e:  # a failed step fails the requests in it, not the server
                    deltas, error = [], e
                targets = dict(self._queues)
                if error is not None:
                    for request_id in list(targets):
                        self.engine.abort(request_id)
                        self._queues.pop(request_id, None)
                for d in deltas:
                    if d.finish_reason is not None:
                        self._queues.pop(d.request_id, None)
            if error is not None:
                for request_id, target in targets.items():
                    self._deliver(request_id, target, error)
            for d in deltas:
                target = targets.get(d.request_id)
                if target is not None:
                    self._deliver(d.request_id, target, d)

    def _deliver(self, request_id: int, target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # its caller's event loop is closed: nobody listens, and this thread must go on
            self.abort(request_id)
