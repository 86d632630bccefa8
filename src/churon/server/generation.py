"""The engine requests behind one HTTP request (n choices of one or several prompts), run
together on the AsyncLLMEngine, their deltas merged into one stream, timed for /metrics.

A response's first byte goes out only after every engine request has produced its first
token: a bad prompt is then still a 400, never an error in the middle of a 200 stream.
start_generation and finish_generation are that contract in HTTP terms, for every API's routes:
admission, the 400 of a prompt the engine refuses, the 499 of a client that left.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request

from churon.engine import AsyncLLMEngine, CompletionOutput, Delta
from churon.errors import ContextLengthError
from churon.sampling import SamplingParams
from churon.server.errors import APIError
from churon.server.metrics import ServerMetrics
from churon.server.state import ServerState


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams


class ClientDisconnected(Exception):
    pass


class Generation:
    """The engine requests of one HTTP request: started together, their deltas merged, timed for /metrics."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics, requests: list[EngineRequest]):
        self.engine = engine
        self.metrics = metrics
        self.requests = requests
        self.arrival = time.perf_counter()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Queue every request and wait for each one's first token; bad input raises here."""
        streams = [self.engine.generate(r.prompt_ids, r.params) for r in self.requests]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            for s in streams:
                await s.aclose()  # aborts the requests that did start
            raise errors[0]
        now = time.perf_counter()
        for r in self.requests:
            self.metrics.prompt_tokens += len(r.prompt_ids)
        for index, (stream, first) in enumerate(zip(streams, firsts)):
            self.metrics.time_to_first_token.observe(now - self.arrival)
            self._tasks.append(asyncio.create_task(self._pump(index, stream, first, now)))

    async def _pump(self, index: int, stream: AsyncIterator[Delta], first: Delta, first_time: float) -> None:
        delta, last, finished = first, first_time, False
        try:
            while True:
                self._queue.put_nowait((index, delta))
                if delta.finish_reason is not None:
                    finished = True
                    self.metrics.generation_tokens += len(delta.output.token_ids)
                    self.metrics.requests_finished[delta.finish_reason] += 1
                    return
                delta = await stream.__anext__()
                now = time.perf_counter()
                self.metrics.inter_token_latency.observe(now - last)
                last = now
        except Exception as e:  # an engine failure: the consumer raises it
            self._queue.put_nowait((index, e))
        finally:
            if not finished:
                self.metrics.requests_finished["abort"] += 1
            await stream.aclose()  # a cancelled pump (the client went away) aborts its request, freeing its blocks

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) as they come, until every request has finished."""
        remaining = len(self.requests)
        try:
            while remaining:
                index, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield index, item
                if item.finish_reason is not None:
                    remaining -= 1
        finally:
            self.cancel()

    async def outputs(self) -> list[CompletionOutput]:
        """Every request run to its end; outputs in request order."""
        outputs: list[CompletionOutput | None] = [None] * len(self.requests)
        async for index, delta in self.deltas():
            if delta.finish_reason is not None:
                outputs[index] = delta.output
        return outputs  # type: ignore[return-value]

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()


async def start_generation(request: Request, state: ServerState, requests: list[EngineRequest],
                           prompt_param: str) -> Generation:
    """Admit the requests and start them; prompt_param: the request field a too-long prompt came from."""
    _, engine = state.ready()
    with state.admission.admit(len(requests)):
        generation = Generation(engine, state.metrics, requests)
        try:
            await until_disconnected(request, generation.start())
        except ContextLengthError as e:
            raise APIError(400, str(e), param=prompt_param, code="context_length_exceeded")
        except ValueError as e:  # sampling parameters, token ids, a JSON schema the engine refused
            raise APIError(400, str(e))
    return generation


async def finish_generation(request: Request, generation: Generation) -> list[CompletionOutput]:
    """Every output, unless the client leaves first."""
    try:
        return await until_disconnected(request, generation.outputs())
    except ClientDisconnected:
        # nobody reads the answer; the status is for the logs and /metrics (nginx's "client closed request")
        raise APIError(499, "the client disconnected")


async def until_disconnected(request: Request, work):
    """Await `work` unless the client goes away first; then cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientDisconnected


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
