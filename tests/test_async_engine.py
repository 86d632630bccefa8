"""AsyncLLMEngine: concurrent asyncio requests, cancellation frees blocks, errors reach the caller."""

import asyncio
import threading
import time

import pytest

from churon import SamplingParams
from churon.engine.async_engine import AsyncLLMEngine
from churon.config import EngineConfig
from churon.engine import LLMEngine
from churon.errors import ContextLengthError
from churon.loader import load_model
from tiny_models import make_hf_model

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    model, tokenizer, _ = load_model(make_hf_model("qwen3", tmp_path_factory.mktemp("qwen3")))
    return model, tokenizer


@pytest.fixture
def engines(model_and_tokenizer):
    make = lambda: LLMEngine(*model_and_tokenizer, EngineConfig(kv_cache_memory=4 << 20))  # noqa: E731
    async_engine = AsyncLLMEngine(make())
    yield async_engine, make()
    async_engine.shutdown()


def test_concurrent_requests_match_the_sync_engine(engines):
    async_engine, sync_engine = engines
    prompts = [[5 + i, 17, 42 + i, 9] * (i + 1) for i in range(8)]

    async def one(prompt):
        text = ""
        async for delta in async_engine.generate(prompt, PARAMS):
            text += delta.text
            last = delta.output
        return last.token_ids, text, last.finish_reason

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(main())
    expected = sync_engine.generate(prompts, PARAMS)
    assert [r[0] for r in results] == [e.token_ids for e in expected]
    assert [r[1] for r in results] == [e.text for e in expected]
    assert all(r[2] == "length" for r in results)


def test_a_consumer_that_stops_listening_aborts_its_request(engines):
    async_engine, _ = engines

    async def main():
        stream = async_engine.generate([5] * 20, SamplingParams(max_tokens=200, ignore_eos=True))
        async for delta in stream:
            break
        await stream.aclose()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    stats = async_engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_cache_usage == 0


def test_an_abort_during_a_step_is_applied_when_the_step_ends(engines):
    async_engine, _ = engines

    async def main():
        stream = async_engine.generate([5] * 20, SamplingParams(max_tokens=200, ignore_eos=True))
        first = await anext(stream)
        with async_engine._lock:  # as if a step were running: abort must not wait for it
            async_engine.abort(first.request_id)
            assert async_engine.engine.has_unfinished()  # not applied yet
        for _ in range(100):  # the engine thread applies it before its next step
            await asyncio.sleep(0.01)
            if async_engine.stats().running == 0:
                break
        await stream.aclose()

    asyncio.run(main())
    stats = async_engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_cache_usage == 0


def test_a_new_request_goes_in_before_the_next_step(engines):
    """A request that comes while a step runs waits for that step only: the engine thread lets the requests queuing
    for its lock in before it takes the next step (a plain lock went back to the thread that had just released it,
    and a new request waited several decode steps). Its time to first token counts from the call."""
    async_engine, _ = engines
    engine = async_engine.engine
    real_step, release, stepping = engine.step, threading.Event(), threading.Event()
    seen: list[int] = []  # per step: how many requests the engine held when it began
    arrivals: dict[int, float] = {}

    def step():
        seen.append(len(engine.requests))
        arrivals.update((i, r.arrival) for i, r in engine.requests.items())
        stepping.set()
        release.wait(10)  # the first step is held until the newcomer waits for the lock
        return real_step()

    engine.step = step

    async def main():
        first = async_engine.generate([5] * 8, SamplingParams(max_tokens=40, ignore_eos=True))
        task = asyncio.create_task(anext(first))
        await asyncio.to_thread(stepping.wait, 10)
        second = async_engine.generate([6] * 8, SamplingParams(max_tokens=2, ignore_eos=True))
        called = time.perf_counter()
        queued = asyncio.create_task(anext(second))
        for _ in range(500):
            await asyncio.sleep(0.002)
            if async_engine._adders:  # the newcomer waits for the lock
                break
        assert async_engine._adders == 1
        waiting = time.perf_counter()
        release.set()
        await task
        delta = await queued
        assert called <= arrivals[delta.request_id] <= waiting  # from the call, not from when it got the lock
        await first.aclose()
        await second.aclose()

    try:
        asyncio.run(main())
    finally:
        engine.step = real_step
    assert seen[:2] == [1, 2]


def test_bad_requests_raise_in_the_caller_and_the_engine_keeps_serving(engines):
    async_engine, _ = engines

    async def main():
        with pytest.raises(ContextLengthError):
            async for _ in async_engine.generate([5] * 5000, PARAMS):
                pass
        return [d async for d in async_engine.generate([5, 6, 7], PARAMS)]

    deltas = asyncio.run(main())
    assert deltas[-1].output.finish_reason == "length"
