"""One request never fails another. A request whose logits go NaN, or whose sampling, grammar or
detokenizer fails, finishes alone with finish_reason "error" (LLMEngine, LLM) or raises GenerationError
in its own stream (AsyncLLMEngine), while the requests beside it produce exactly what they produce
alone; parameters that would make a distribution non-finite are refused or floored; aborting queued
requests costs O(1) each."""

import asyncio
import math

import httpx2 as httpx
import openai
import pytest

from churon import LLM, SamplingParams
from churon.config import EngineConfig
from churon.engine import AsyncLLMEngine, LLMEngine
from churon.engine.block_manager import BlockManager
from churon.engine.scheduler import Scheduler
from churon.engine.sequence import Sequence
from churon.errors import GenerationError
from churon.loader import load_model
from tiny_models import make_hf_model

POISON = 333  # the token whose embedding row the poisoned model makes NaN (only POISONED's prompt has it)
POISONED = [7, 8, POISON, 9]
PROMPTS = [[5 + i, 17, 42 + i, 9] * (i + 1) for i in range(8)]
# greedy and seeded sampling, with the sampler's filters and penalties
PARAMS = [
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=0) if i % 2 else
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1, seed=i)
    for i in range(8)
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # untied: the poisoned embedding row must not be a row of the LM head, which every request reaches
    return make_hf_model("qwen3", tmp_path_factory.mktemp("qwen3"), tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model_and_tokenizer(model_dir):
    model, tokenizer, _ = load_model(model_dir)
    return model, tokenizer


def make_engine(model_and_tokenizer) -> LLMEngine:
    return LLMEngine(*model_and_tokenizer, EngineConfig(kv_cache_memory=4 << 20))


def poison(monkeypatch, model) -> None:
    """A model whose embedding of POISON is NaN: its forward makes NaN logits for sequences holding it, only."""
    real = model.backend.embedding

    def embedding(table, ids):
        x = real(table, ids)
        x[ids == POISON] = math.nan
        return x

    monkeypatch.setattr(model.backend, "embedding", embedding)
    monkeypatch.setattr(model, "fused_stack", None)  # op by op, through the poisoned embedding (the stack's bits are the same)


@pytest.fixture(scope="module")
def alone(model_and_tokenizer):
    """What each of PROMPTS produces run alone (before anything is poisoned)."""
    engine = make_engine(model_and_tokenizer)
    return [engine.generate([p], sp)[0] for p, sp in zip(PROMPTS, PARAMS)]


def assert_same(outputs, expected):
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    assert [o.text for o in outputs] == [e.text for e in expected]
    assert all(o.finish_reason == "length" and o.error is None for o in outputs)


def assert_idle(engine: LLMEngine):
    stats = engine.stats()
    assert not engine.has_unfinished() and not engine.requests
    assert stats.running == stats.waiting == 0 and stats.kv_cache_usage == 0


# -- parameters ------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300), ("repetition_penalty", 0.0),
    ("repetition_penalty", math.nan), ("logit_bias", {3: 1e31}), ("logit_bias", {3: -math.inf}),
])
def test_parameters_that_overflow_the_logits_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"invalid sampling parameter {field}="):
        SamplingParams(**{field: value})


def test_a_tiny_temperature_samples_at_the_floor_and_a_tiny_top_p_keeps_the_top_token(model_and_tokenizer, alone):
    engine = make_engine(model_and_tokenizer)
    base = {"max_tokens": 10, "ignore_eos": True, "seed": 3}
    tiny_temperature = [SamplingParams(temperature=t, **base) for t in (1e-39, 1e-46, 1e-300)]
    tiny_top_p = [SamplingParams(temperature=1.0, top_p=p, **base) for p in (1e-46, 5e-324)]
    outs = engine.generate([PROMPTS[0]] * 5 + PROMPTS, tiny_temperature + tiny_top_p + PARAMS)
    floor = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.01, **base))[0]
    greedy = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, **base))[0]
    assert all(o.token_ids == floor.token_ids for o in outs[:3])  # vLLM's rule: below 0.01 samples as 0.01
    assert all(o.token_ids == greedy.token_ids for o in outs[3:5])
    assert_same(outs[5:], alone)
    assert_idle(engine)


# -- one request fails, the others go on -----------------------------------------------


def test_nan_logits_fail_that_request_alone(model_and_tokenizer, alone, monkeypatch):
    engine = make_engine(model_and_tokenizer)
    poison(monkeypatch, model_and_tokenizer[0])
    # the poisoned request greedy and sampled, among the others, arriving between them
    prompts = PROMPTS[:4] + [POISONED, POISONED] + PROMPTS[4:]
    params = PARAMS[:4] + [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1)] + PARAMS[4:]
    outs = engine.generate(prompts, params)
    for bad in outs[4:6]:
        assert bad.finish_reason == "error" and bad.token_ids == [] and bad.text == ""
        assert "the model produced NaN logits" in bad.error
    assert_same(outs[:4] + outs[6:], alone)
    assert_idle(engine)
    # its blocks, NaN K/V included, went back to the pool: later requests reusing them are unaffected
    assert_same(engine.generate(PROMPTS, PARAMS), alone)


def test_a_non_finite_distribution_from_the_parameters_fails_that_request_alone(model_and_tokenizer, alone):
    """The sampler's last line of defence, for parameters that got past validation."""
    engine = make_engine(model_and_tokenizer)
    bad = SamplingParams(temperature=1.0, repetition_penalty=2.0, max_tokens=10)
    bad.repetition_penalty = 1e-300  # set after validation: penalized logits / 0 = inf
    outs = engine.generate(PROMPTS + [PROMPTS[0]], PARAMS + [bad])
    assert outs[-1].finish_reason == "error"
    error = outs[-1].error
    assert error.startswith("no token could be drawn: the sampling parameters") and "repetition_penalty=1e-300" in error
    assert_same(outs[:-1], alone)
    assert_idle(engine)


@pytest.mark.parametrize("stage", ["detokenizer", "grammar"])
def test_a_failing_stage_of_one_request_fails_it_alone(model_and_tokenizer, alone, stage):
    engine = make_engine(model_and_tokenizer)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    victim = engine.requests[ids[3]]

    def boom(*args):
        raise RuntimeError(f"{stage} broke")

    if stage == "detokenizer":
        victim.detokenizer.update = boom
    else:  # as if it had a grammar whose matcher failed
        victim.grammar = type("Broken", (), {"allowed_tokens": boom})()
    outputs = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.finish_reason is not None:
                outputs[d.request_id] = d.output
    failed = outputs.pop(ids[3])
    assert failed.finish_reason == "error" and failed.error == f"internal error: RuntimeError: {stage} broke"
    assert_same([outputs[i] for i in ids if i != ids[3]], alone[:3] + alone[4:])
    assert_idle(engine)


def test_llm_reports_the_failed_prompt_and_stays_usable(model_dir, alone, monkeypatch):
    llm = LLM(model_dir, threads=1)
    poison(monkeypatch, llm.model)
    outs = llm.generate(PROMPTS + [POISONED], PARAMS + [SamplingParams(temperature=0)])
    assert outs[-1].finish_reason == "error" and "NaN" in outs[-1].error
    assert_same(outs[:-1], alone)
    with pytest.raises(GenerationError, match="the model produced NaN logits"):  # a stream raises
        list(llm.stream(POISONED, SamplingParams(temperature=0)))
    assert_same(llm.generate(PROMPTS, PARAMS), alone)

    # a step that fails as a whole fails that call, and leaves nothing behind in the engine
    def broken_forward(*args):
        raise RuntimeError("the forward broke")

    with monkeypatch.context() as m:
        m.setattr(llm.engine.runner, "execute", broken_forward)
        with pytest.raises(RuntimeError, match="the forward broke"):
            llm.generate(PROMPTS, PARAMS)
    assert_idle(llm.engine)
    assert_same(llm.generate(PROMPTS, PARAMS), alone)


def test_the_async_engine_fails_only_that_stream(model_and_tokenizer, alone, monkeypatch):
    async_engine = AsyncLLMEngine(make_engine(model_and_tokenizer))
    poison(monkeypatch, model_and_tokenizer[0])

    async def one(prompt, params):
        async for delta in async_engine.generate(prompt, params):
            last = delta.output
        return last

    async def main(with_poisoned):
        runs = [one(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        if with_poisoned:
            runs.insert(3, one(POISONED, SamplingParams(temperature=0.5, max_tokens=10)))
        return await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 60)

    try:
        results = asyncio.run(main(with_poisoned=True))
        error = results.pop(3)
        assert isinstance(error, GenerationError) and "the model produced NaN logits" in str(error)
        assert_same(results, alone)
        assert_idle(async_engine.engine)
        assert_same(asyncio.run(main(with_poisoned=False)), alone)
    finally:
        async_engine.shutdown()


def test_a_caller_whose_event_loop_closed_does_not_stop_the_engine(model_and_tokenizer, alone):
    async_engine = AsyncLLMEngine(make_engine(model_and_tokenizer))
    try:
        loop = asyncio.new_event_loop()
        stream = async_engine.generate([5] * 20, SamplingParams(max_tokens=200, ignore_eos=True))
        loop.run_until_complete(anext(stream))
        loop.close()  # the stream is left open: its deltas now go to a closed loop
        async def main():
            return await asyncio.wait_for(anext(async_engine.generate(PROMPTS[0], PARAMS[0])), 60)
        assert asyncio.run(main()).token_id == alone[0].token_ids[0]
    finally:
        async_engine.shutdown()


def test_the_server_fails_only_that_client(model_dir, monkeypatch):
    """Through the HTTP server and the official client: a 500 for the failed request, an error event in
    a stream that fails after its first token, and every other client's answer as it is alone."""
    from churon.server import create_app

    llm = LLM(model_dir, threads=1)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.text for o in llm.generate(PROMPTS, greedy)]
    poison(monkeypatch, llm.model)
    app = create_app(lambda: llm, "tiny")

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                while (await http.get("/health")).status_code != 200:
                    await asyncio.sleep(0.05)
                client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)

                async def complete(prompt):
                    r = await client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=8,
                                                        extra_body={"ignore_eos": True})
                    return r.choices[0].text

                async def stream_that_fails_after_its_first_token():
                    chunks = []
                    # its first token is POISON (forced): the step after it runs on a NaN embedding
                    stream = await client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, stream=True,
                                                             logit_bias={str(POISON): 100})
                    with pytest.raises(openai.APIError, match="the model produced NaN logits"):
                        async for chunk in stream:
                            chunks.append(chunk)
                    return chunks

                runs = [complete(p) for p in PROMPTS]
                runs.insert(2, complete(POISONED))
                runs.insert(5, stream_that_fails_after_its_first_token())
                results = await asyncio.gather(*runs, return_exceptions=True)
                failed, chunks = results.pop(2), results.pop(4)
                assert isinstance(failed, openai.InternalServerError) and "the model produced NaN logits" in failed.message
                assert len(chunks) == 1 and chunks[0].choices[0].text == llm.tokenizer.decode([POISON])
                assert results == expected
                assert [await complete(p) for p in PROMPTS[:2]] == expected[:2]

    asyncio.run(main())
    assert_idle(llm.engine)


# -- abort -----------------------------------------------------------------------------


class CountedSequence(Sequence):
    """Counts comparisons: a queue that scans for the sequence to remove compares it with those before it."""

    comparisons = 0

    def __eq__(self, other):
        CountedSequence.comparisons += 1
        return self is other

    __hash__ = Sequence.__hash__


def test_aborting_queued_requests_costs_o1_each():
    n = 4000
    sched = Scheduler(BlockManager(64, 16, True), max_num_seqs=4)
    seqs = [CountedSequence([1, 2, 3], SamplingParams(max_tokens=1), seq_id=i) for i in range(n)]
    for s in seqs:
        sched.add(s)
    keep = set(range(0, n, 1000))
    CountedSequence.comparisons = 0
    for s in reversed(seqs):  # the newest first: the worst order for a scan from the head
        if s.seq_id not in keep:
            assert sched.abort(s.seq_id)
    assert CountedSequence.comparisons == 0  # a scan would compare n^2 / 2 = 8 million times
    kept = [s for s in seqs if s.seq_id in keep]
    assert sched.num_waiting == len(kept) and sched.waiting == kept
    assert all(s.finish_reason == "abort" for s in seqs if s.seq_id not in keep)
    assert [x.seq for x in sched.schedule().scheduled] == kept  # FCFS among those left
