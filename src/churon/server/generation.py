"""The engine requests behind one HTTP request (n choices of one or several prompts), run
together on the AsyncLLMEngine, their deltas merged into one stream, timed for /metrics.

A response's first byte goes out only after every engine request has produced its first
token: a bad prompt is then still a 400, never an error in the middle of a 200 stream.
start_generation and finish_generation are that contract in HTTP terms, for every API's routes:
admission, the 400 of a prompt the engine refuses, the 499 of a client that left, the 500 of a
request that failed alone (GenerationError: the model's logits were NaN; the others go on), the
503 of a request the server's shutdown ended (drain.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request

from churon.engine import AsyncLLMEngine, CompletionOutput, Delta
from churon.engine.lora import UnknownLoraError
from churon.errors import ContextLengthError, GenerationError
from churon.sampling import SamplingParams
from churon.server.drain import Drain
from churon.server.errors import APIError
from churon.server.lora import AdapterView
from churon.server.metrics import ServerMetrics
from churon.server.state import ServedModel, ServerState


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams


class ClientDisconnected(Exception):
    pass


class Generation:
    """The engine requests of one HTTP request: started together, their deltas merged, timed for /metrics."""

    def __init__(self, engine: AsyncLLMEngine, metrics: ServerMetrics, requests: list[EngineRequest], drain: Drain):
        self.engine = engine
        self.metrics = metrics
        self.drain = drain
        self.requests = requests
        self.arrival = time.perf_counter()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Queue every request and wait for each one's first token; bad input raises here."""
        streams = [self.engine.generate(r.prompt_ids, r.params) for r in self.requests]
        try:
            firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        except asyncio.CancelledError:  # the client left (or the shutdown ended it) while they were queued
            self.metrics.requests_finished["abort"] += len(streams)
            for s in streams:
                await s.aclose()
            raise
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            for s, f in zip(streams, firsts):
                if isinstance(f, GenerationError):
                    self.metrics.requests_finished["error"] += 1
                elif not isinstance(f, BaseException):  # started, and ended here for the others' error
                    self.metrics.requests_finished["abort"] += 1
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
        except GenerationError as e:  # this request failed alone: the consumer raises it
            finished = True
            self.metrics.requests_finished["error"] += 1
            self._queue.put_nowait((index, e))
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
            self.drain.untrack(self)

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

    def end(self, error: BaseException) -> None:
        """End it now, unfinished (the server's shutdown): its requests are aborted, deltas() raises error."""
        self.cancel()
        self._queue.put_nowait((None, error))


async def start_generation(request: Request, state: ServerState, served: ServedModel | AdapterView,
                           requests: list[EngineRequest], prompt_param: str) -> Generation:
    """Admit the requests and start them on the served model (ServerState.model_for's, for "generate"), with
    its LoRA adapter when the request named one; prompt_param: the request field a too-long prompt came from."""
    state.ready()  # the shutdown may have begun while the prompt was built
    if served.lora is not None:  # every API's requests get their adapter here, whatever their sampling fields
        requests = [EngineRequest(r.prompt_ids, dataclasses.replace(r.params, lora=served.lora)) for r in requests]
    with state.admission.admit(len(requests)):
        generation = Generation(served.engine, state.metrics, requests, state.drain)
        try:
            await until_ended(request, state.drain, generation.start())
        except ContextLengthError as e:
            raise APIError(400, str(e), param=prompt_param, code="context_length_exceeded")
        except UnknownLoraError as e:  # unloaded since the request looked its model up
            raise APIError(404, str(e), param="model", code="model_not_found", type="not_found_error")
        except ValueError as e:  # sampling parameters, token ids, a JSON schema the engine refused
            raise APIError(400, str(e))
        except GenerationError as e:  # failed at its first token
            raise APIError(500, str(e), type="server_error")
    # from here its deltas go to a stream or to finish_generation: the shutdown ends it through them
    state.drain.track(generation)
    return generation


async def finish_generation(request: Request, generation: Generation) -> list[CompletionOutput]:
    """Every output, unless the client leaves first."""
    try:
        return await until_disconnected(request, generation.outputs())
    except ClientDisconnected:
        # nobody reads the answer; the status is for the logs and /metrics (nginx's "client closed request")
        raise APIError(499, "the client disconnected")
    except GenerationError as e:
        raise APIError(500, str(e), type="server_error")


async def until_disconnected(request: Request, work):
    """Await `work` unless the client goes away first; then cancel it (aborting its requests)."""
    return await until_ended(request, None, work)


async def until_ended(request: Request, drain: Drain | None, work):
    """Await `work` unless the client goes away (ClientDisconnected) or the server's shutdown grace runs out
    (its 503) first; either cancels it, aborting its requests."""
    task = asyncio.ensure_future(work)
    watchers = {asyncio.ensure_future(_disconnect(request))}
    if drain is not None:
        watchers.add(expired := asyncio.ensure_future(drain.expired.wait()))
    try:
        done, _ = await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        for watcher in watchers:
            watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    if drain is not None and expired in done:
        raise drain.error()
    raise ClientDisconnected


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
