"""Speculative decoding on the real SmolLM2-135M-Instruct Q4_1: with prompt lookup and with a draft made by
`churon quantize` of SmolLM2 itself at Q4_0 (the same tokenizer), greedy outputs are bitwise the outputs without
speculation, alone and in a mixed batch of 16; a json_schema request and seeded sampling give the same text; and
on a prompt that asks for a text to be repeated, prompt lookup's proposals are mostly accepted.

The reference is the same engine configuration with speculative=None.
"""

import json
import random

import pytest

from churon import LLM, SamplingParams
from churon.cli import main
from churon.config import EngineConfig
from churon.engine import LLMEngine
from churon.loader import load_model

pytestmark = pytest.mark.slow

TEXT = (
    "The lighthouse stood at the end of the long stone pier, white and red, its lamp turning slowly through the "
    "night. Every evening the keeper climbed the one hundred and twelve steps to the top, wound the clockwork, "
    "trimmed the wick and polished the great glass lens until it shone. Ships far out at sea saw the light and "
    "knew where the rocks were. In the winter storms the waves broke over the pier and the spray reached the "
    "windows of the lamp room, but the light never went out. The keeper kept a log of every ship that passed, "
    "writing down its name, the time and the weather, in a thick book bound in green leather. When he grew old, "
    "his daughter took over the work, and she kept the same book, in the same careful handwriting, for forty "
    "more years. She painted the tower every spring, red at the top and white below, and she planted a small "
    "garden of herbs and potatoes behind the keeper's cottage, where the wall kept off the wind. Fishermen from "
    "the village brought her letters and bread on Sundays, and in return she told them what the barometer said "
    "and which way the clouds were moving. On clear nights she could see the lights of three other lighthouses "
    "along the coast, and she liked to think of the keepers there, winding their own clockwork at the same hour. "
    "When the lamp was finally made electric, she kept the old brass oil can on the shelf by the door."
)
QUOTE = [{"role": "user", "content": "Repeat this text exactly:\n\n" + TEXT}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PERSON = [{"role": "user", "content": "Make up a person. Give their name, age and city as JSON."}]

NGRAM = {"method": "ngram", "num_tokens": 5, "adaptive": False}


@pytest.fixture(scope="module")
def draft_path(smollm2_gguf, tmp_path_factory):
    """SmolLM2 itself requantized to Q4_0 by `churon quantize`: a draft of the same vocabulary."""
    out = tmp_path_factory.mktemp("smollm2-q4_0") / "smollm2-q4_0.gguf"
    assert main(["quantize", str(smollm2_gguf), str(out), "--type", "Q4_0", "-q"]) == 0
    return out


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(smollm2_gguf, threads=2, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def draft(llm, draft_path):
    """The Q4_0 draft loaded as LLM loads one: on the target's own kernels."""
    return load_model(draft_path, dtype=llm.model.backend.dtype, kernels=llm.model.backend.name)[:2]


def specs(draft_path) -> dict[str, dict]:
    return {
        "ngram": NGRAM,
        "ngram-adaptive": {"method": "ngram"},
        "draft": {"method": "draft", "model": str(draft_path), "num_tokens": 4, "adaptive": False},
        "draft-adaptive": {"method": "draft", "model": str(draft_path)},
    }


def make_engine(llm, draft, spec: dict | None = None, **options) -> LLMEngine:
    options.setdefault("kv_cache_memory", 64 << 20)
    draft_model, draft_tokenizer = draft if spec is not None and spec["method"] == "draft" else (None, None)
    return LLMEngine(llm.model, llm.tokenizer, EngineConfig(speculative=spec, **options),
                     draft_model=draft_model, draft_tokenizer=draft_tokenizer)


def prompts(llm) -> list[list[int]]:
    """The quoting prompt (~300 tokens to repeat), code, a counting list and a chat question."""
    return [
        llm.chat_prompt_ids(QUOTE),
        llm.tokenizer.encode("def fibonacci(n):\n    "),
        llm.tokenizer.encode("1, 2, 3, 4, 5,"),
        llm.chat_prompt_ids([{"role": "user", "content": "List the planets of the solar system, one per line."}]),
    ]


def assert_same_outputs(got, expected):
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.token_ids == e.token_ids, f"request {i}: {g.text!r} vs {e.text!r}"
        assert (g.text, g.finish_reason) == (e.text, e.finish_reason), f"request {i}"
        assert g.logprobs == e.logprobs, f"request {i}: logprobs"


def assert_nothing_held(eng: LLMEngine):
    assert not eng.has_unfinished() and eng.block_manager.num_used_blocks == 0
    if hasattr(eng.speculator.proposer, "num_used_blocks"):
        assert eng.speculator.proposer.num_used_blocks == 0


def test_the_quoting_prompt_is_long(llm):
    assert len(llm.tokenizer.encode(TEXT)) >= 280


@pytest.mark.parametrize("spec_name", ["ngram", "ngram-adaptive", "draft", "draft-adaptive"])
def test_greedy_alone_equals_no_speculation(llm, draft, draft_path, spec_name):
    ps = prompts(llm)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (400, 64, 64, 80)]
    reference = make_engine(llm, draft)
    expected = [reference.generate([p], [sp])[0] for p, sp in zip(ps, params)]
    assert expected[0].finish_reason == "stop" and TEXT[:200] in expected[0].text  # it did quote the text
    eng = make_engine(llm, draft, specs(draft_path)[spec_name])
    got = [eng.generate([p], [sp])[0] for p, sp in zip(ps, params)]
    assert_same_outputs(got, expected)
    s = eng.stats()
    if spec_name == "draft-adaptive":
        # the Q4_0 draft reads 0.93x the model's bytes a token: no proposal can pay, so the adaptive length never makes one
        assert s.spec_proposed_tokens == 0, s
    else:
        assert 0 < s.spec_accepted_tokens < s.spec_proposed_tokens, s
    assert_nothing_held(eng)


def test_prompt_lookup_is_mostly_accepted_on_a_quoting_prompt(llm, draft, draft_path):
    """A real property of prompt lookup: a request that repeats its prompt accepts most proposals (measured here:
    about 0.98 with num_tokens 5 and 4, n-grams of 2 to 4 tokens), so each verification gives several tokens."""
    ids = llm.chat_prompt_ids(QUOTE)
    params = SamplingParams(temperature=0, max_tokens=400)
    for spec_name in ("ngram", "ngram-adaptive"):
        eng = make_engine(llm, draft, specs(draft_path)[spec_name])
        out = eng.generate([ids], params)[0]
        s = eng.stats()
        print(f"{spec_name}: acceptance rate {s.spec_acceptance_rate:.3f}, {s.spec_mean_accepted_length:.2f} tokens per"
              f" verification, {len(out.token_ids)} tokens in {s.spec_verifications} verifications")
        assert s.spec_acceptance_rate > 0.3, s
        assert s.spec_mean_accepted_length > 2, s
        assert s.spec_verifications < len(out.token_ids) / 2, s


def batch(llm, expected_free) -> tuple[list[list[int]], list[SamplingParams]]:
    """16 requests: the four prompts and more, greedy and seeded sampling, max_tokens from 1 to 400, a stop string
    and a stop token the outputs reach, logprobs, penalties, a json_schema request; the chat prompts share the
    system prompt's prefix (prefix-cache hits)."""
    ps = prompts(llm)
    story = llm.tokenizer.encode("Once upon a time, in a small village by the sea,")
    colors = llm.tokenizer.encode("The three primary colors are")
    quote, code, count, planets = ps
    stop_text = expected_free.text
    stop = stop_text[len(stop_text) // 2 :].split()[0]  # a word from the middle of the planets answer
    stop_token = expected_free.token_ids[len(expected_free.token_ids) // 3]
    chat = llm.chat_prompt_ids
    all_prompts = [quote, code, count, planets, story, colors, quote, planets, planets, code, story, count,
                   chat(PERSON), chat([{"role": "user", "content": "What is 2 + 2?"}]), colors, quote]
    g = {"temperature": 0}
    all_params = [
        SamplingParams(max_tokens=400, **g),
        SamplingParams(max_tokens=1, **g),
        SamplingParams(max_tokens=2, **g),
        SamplingParams(max_tokens=80, **g),
        SamplingParams(temperature=0.9, top_p=0.95, seed=1, max_tokens=60),
        SamplingParams(temperature=0.9, top_p=0.95, seed=2, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=40, seed=3, max_tokens=300),
        SamplingParams(stop=[stop], max_tokens=80, **g),
        SamplingParams(stop_token_ids=[stop_token], max_tokens=80, **g),
        SamplingParams(logprobs=2, max_tokens=48, **g),
        SamplingParams(temperature=0.8, seed=4, logprobs=2, max_tokens=48),
        SamplingParams(repetition_penalty=1.3, max_tokens=48, **g),
        SamplingParams(json_schema=SCHEMA, max_tokens=80, **g),
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, max_tokens=30, **g),
        SamplingParams(max_tokens=33, ignore_eos=True, **g),
        SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=400),
    ]
    return all_prompts, all_params


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 48, "kv_cache_memory": 34 << 20}],
                         ids=["default", "chunked-prefill-preemption"])
@pytest.mark.parametrize("spec_name", ["ngram", "draft"])
def test_a_mixed_batch_of_16_equals_no_speculation(llm, draft, draft_path, spec_name, options):
    planets = prompts(llm)[3]
    free = make_engine(llm, draft).generate([planets], SamplingParams(temperature=0, max_tokens=80))[0]
    ps, params = batch(llm, free)
    reference = make_engine(llm, draft, **options)
    expected = reference.generate(ps, params)
    assert expected[7].finish_reason == "stop" and len(expected[7].token_ids) < len(free.token_ids)  # the stop string
    assert expected[8].finish_reason == "stop" and len(expected[8].token_ids) < len(free.token_ids)  # the stop token
    json.loads(expected[12].text)
    eng = make_engine(llm, draft, specs(draft_path)[spec_name], **options)
    got = eng.generate(ps, params)
    assert_same_outputs(got, expected)
    s = eng.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_proposed_tokens, s
    assert s.prefix_cache_hit_blocks > 0, s
    if options:
        assert s.preemptions > 0 and reference.stats().preemptions > 0, s
    assert_nothing_held(eng)


@pytest.mark.parametrize("spec_name", ["ngram", "draft"])
def test_json_schema_with_speculation_equals_without(llm, draft, draft_path, spec_name):
    ids = llm.chat_prompt_ids(PERSON)
    params = [SamplingParams(temperature=0, max_tokens=80, json_schema=SCHEMA)] + [
        SamplingParams(temperature=0.8, seed=seed, max_tokens=80, json_schema=SCHEMA) for seed in range(3)
    ]
    expected = [make_engine(llm, draft).generate([ids], [sp])[0] for sp in params]
    eng = make_engine(llm, draft, specs(draft_path)[spec_name])
    got = [eng.generate([ids], [sp])[0] for sp in params]
    assert_same_outputs(got, expected)
    for out in got:
        assert out.finish_reason == "stop"
        assert set(json.loads(out.text)) == {"name", "age", "city"}
    assert eng.stats().spec_proposed_tokens > 0
    assert_nothing_held(eng)


@pytest.mark.parametrize("spec_name", ["ngram", "draft"])
def test_seeded_sampling_gives_the_same_text(llm, draft, draft_path, spec_name):
    ps = prompts(llm)
    cases = [(ps[0], SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=300)),
             (ps[0], SamplingParams(temperature=0.5, seed=8, max_tokens=300)),
             (ps[3], SamplingParams(temperature=0.9, top_p=0.95, seed=9, max_tokens=80)),
             (ps[1], SamplingParams(temperature=0.9, top_p=0.95, seed=10, max_tokens=64))]
    rng = random.Random(0)
    rng.shuffle(cases)
    expected = [make_engine(llm, draft).generate([p], [sp])[0] for p, sp in cases]
    eng = make_engine(llm, draft, specs(draft_path)[spec_name])
    alone = [eng.generate([p], [sp])[0] for p, sp in cases]
    batched = eng.generate([p for p, _ in cases], [sp for _, sp in cases])
    assert_same_outputs(alone, expected)
    assert_same_outputs(batched, expected)
    s = eng.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_proposed_tokens, s
    assert_nothing_held(eng)


def test_llm_with_the_quantized_draft_equals_llm_without(smollm2_gguf, llm, draft_path):
    """The public path: LLM(..., speculative={"method": "draft", "model": PATH}) loads the draft itself."""
    spec_llm = LLM(smollm2_gguf, threads=2, kv_cache_memory=64 << 20,
                   speculative={"method": "draft", "model": str(draft_path), "adaptive": False})
    ids = llm.chat_prompt_ids(QUOTE)
    params = SamplingParams(temperature=0, max_tokens=120)
    assert spec_llm.generate([ids], params)[0].token_ids == llm.generate([ids], params)[0].token_ids
    assert spec_llm.engine.stats().spec_accepted_tokens > 0
