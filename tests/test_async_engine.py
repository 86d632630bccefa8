"""AsyncLLMEngine: concurrent asyncio requests, cancellation frees blocks, errors reach the caller."""

import asyncio

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


def test_bad_requests_raise_in_the_caller_and_the_engine_keeps_serving(engines):
    async_engine, _ = engines

    async def main():
        with pytest.raises(ContextLengthError):
            async for _ in async_engine.generate([5] * 5000, PARAMS):
                pass
        return [d async for d in async_engine.generate([5, 6, 7], PARAMS)]

    deltas = asyncio.run(main())
    assert deltas[-1].output.finish_reason == "length"
