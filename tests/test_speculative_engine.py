"""Speculative decoding in the engine on tiny models: with prompt lookup and with a draft model, every output is
bitwise the output without speculation (token ids, text, finish reason, logprobs), alone and in a batch of mixed
requests, across chunked prefill, prefix-cache hits, preemption, stop strings, stop tokens and a json_schema
request; seeded sampling gives the same tokens; a draft of another vocabulary is a clear error; rejected proposals
never leave blocks behind; and the adaptive length stops proposing where proposals are never accepted.

The reference is always the same engine configuration with speculative=None. Each test also asserts that
speculation happened (proposals made, some accepted and, except for the draft that is the target's own copy, some
rejected): a test where nothing was proposed could not fail.

A random tiny model rarely repeats itself, so the prompts repeat patterns for prompt lookup to find, and the
n-gram settings include ngram_min=1, which proposes on any repeated token. The drafts: "copy", the target's own
file loaded again (its greedy tokens are the target's: every proposal is accepted); "f32", the same weights
unquantized (mostly accepted); "other", another random model with the same tokenizer (almost never accepted).
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from churon import LLM, SamplingParams
from churon.config import EngineConfig
from churon.engine import LLMEngine
from churon.loader import load_model
from churon.tokenizer import from_hf_dir
from test_structured_output import PERSON
from tiny_models import make_hf_model, make_peft_adapter

# adaptive False: every decoding step proposes num_tokens where the proposer has them
NGRAM = {"method": "ngram", "num_tokens": 4, "adaptive": False}  # n-grams of 2..4 tokens
NGRAM_1 = {"method": "ngram", "num_tokens": 6, "ngram_min": 1, "ngram_max": 3, "adaptive": False}
SPECS = {
    "ngram": NGRAM,
    "ngram-1": NGRAM_1,
    "draft-copy": {"method": "draft", "model": "copy", "num_tokens": 4, "adaptive": False},
    "draft-f32": {"method": "draft", "model": "f32", "num_tokens": 5, "adaptive": False},
    "draft-other": {"method": "draft", "model": "other", "num_tokens": 3, "adaptive": False},
}

OPTIONS = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 12},  # prompts run in chunks beside decodes and their proposals
    "preemption": {"block_size": 4, "kv_cache_memory": 64 * 1024},  # 128 tokens of KV: constant preemption
    "no-prefix-cache": {"enable_prefix_caching": False},
    "tiny-budget": {"max_num_batched_tokens": 3},  # proposals cut to the 2 tokens beside the last one, or to none
}


@pytest.fixture(scope="module")
def target(tiny_llama_q8):
    return load_model(tiny_llama_q8)[:2]


@pytest.fixture(scope="module")
def drafts(tiny_llama_q8, tiny_llama_dir, tmp_path_factory):
    """name -> (model, tokenizer) of the draft models (see the module docstring)."""
    other = make_hf_model("llama", tmp_path_factory.mktemp("tiny-llama-other"), seed=1)
    return {
        "copy": load_model(tiny_llama_q8)[:2],
        "f32": load_model(tiny_llama_dir)[:2],
        "other": load_model(other)[:2],
    }


def make_engine(target, drafts, spec: dict | None = None, **options) -> LLMEngine:
    model, tokenizer = target
    options.setdefault("kv_cache_memory", 4 << 20)
    draft_model = draft_tokenizer = None
    if spec is not None and spec["method"] == "draft":
        draft_model, draft_tokenizer = drafts[spec["model"]]
    return LLMEngine(model, tokenizer, EngineConfig(speculative=spec, **options),
                     draft_model=draft_model, draft_tokenizer=draft_tokenizer)


def repeating_prompt(rng: random.Random, length: int) -> list[int]:
    """A random pattern of 2..8 tokens repeated to `length` tokens, with a few tokens changed."""
    pattern = [rng.randrange(3, 399) for _ in range(rng.randrange(2, 9))]
    ids = (pattern * (length // len(pattern) + 1))[:length]
    for _ in range(length // 10):
        ids[rng.randrange(length)] = rng.randrange(3, 399)
    return ids


def batch_prompts(tokenizer, seed: int = 0) -> list[list[int]]:
    """16 prompts of 1 to 60 tokens: repeating patterns, repeated text, random tokens, and four that share a
    32-token prefix (prefix-cache hits within the batch)."""
    rng = random.Random(seed)
    shared = repeating_prompt(rng, 32)
    text = tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the dog sat on the")
    out = [repeating_prompt(rng, n) for n in (60, 45, 30, 20, 12, 8)]
    out += [text, text[:9], [rng.randrange(3, 399)], [rng.randrange(3, 399) for _ in range(40)]]
    out += [shared + repeating_prompt(rng, n) for n in (1, 10, 20, 28)]
    out += [[5, 6], [rng.randrange(3, 399) for _ in range(25)]]
    assert len(out) == 16 and all(1 <= len(p) <= 60 for p in out)
    return out


GREEDY = {"temperature": 0, "ignore_eos": True}


def mixed_params(stop: str, stop_token: int) -> list[SamplingParams]:
    """16 requests' settings: greedy and seeded sampling, max_tokens from 1 to 60, a stop string and a stop token
    that the outputs reach, logprobs, prompt logprobs, penalties, a json_schema request and one that may end on EOS."""
    return [
        SamplingParams(max_tokens=40, **GREEDY),
        SamplingParams(max_tokens=1, **GREEDY),
        SamplingParams(max_tokens=2, **GREEDY),
        SamplingParams(max_tokens=17, **GREEDY),
        SamplingParams(temperature=0.9, top_p=0.95, seed=1, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=2, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=0.5, top_k=20, seed=3, max_tokens=30, ignore_eos=True),
        SamplingParams(stop=[stop], max_tokens=60, **GREEDY),
        SamplingParams(stop_token_ids=[stop_token], max_tokens=60, **GREEDY),
        SamplingParams(logprobs=2, max_tokens=40, **GREEDY),
        SamplingParams(temperature=0.9, seed=4, logprobs=2, max_tokens=30, ignore_eos=True),
        SamplingParams(repetition_penalty=1.3, max_tokens=40, **GREEDY),
        SamplingParams(presence_penalty=0.8, frequency_penalty=0.4, max_tokens=40, **GREEDY),
        SamplingParams(json_schema=PERSON, temperature=0, max_tokens=60),
        SamplingParams(temperature=0, max_tokens=48),  # may end on an end-of-generation token
        SamplingParams(prompt_logprobs=1, logprobs=1, max_tokens=20, **GREEDY),
    ]


def stop_settings(target, drafts, prompts) -> tuple[str, int]:
    """A stop string and a stop token that requests 7 and 8 of mixed_params reach mid-output, from their greedy
    outputs without stops (the outputs with them are checked to stop early)."""
    eng = make_engine(target, drafts)
    free = eng.generate([prompts[7], prompts[8]], SamplingParams(max_tokens=60, **GREEDY))
    text = free[0].text
    stop = next(text[i : i + 2] for i in range(len(text) // 3, len(text)) if text[i : i + 2].isalpha())
    return stop, free[1].token_ids[len(free[1].token_ids) // 2]


def drive(eng: LLMEngine, prompts, params) -> tuple[list, int]:
    """Run the requests to completion step by step, checking after every step that no running sequence holds a
    block more than its tokens need (the blocks of rejected proposals went back at once). Returns the outputs in
    prompt order and the most deltas one request got in one step (> 1: speculation gave it several tokens)."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs, most = {}, 0
    bm = eng.block_manager
    while eng.has_unfinished():
        deltas = eng.step()
        per_request: dict[int, int] = {}
        for d in deltas:
            assert d.token_id is not None, d  # one delta per token
            per_request[d.request_id] = per_request.get(d.request_id, 0) + 1
            if d.finish_reason is not None:
                outputs[d.request_id] = d.output
        most = max([most, *per_request.values()])
        for seq in eng.scheduler.running:
            assert len(seq.block_table) <= bm.num_blocks_for(seq.num_tokens), (seq, seq.block_table)
    return [outputs[i] for i in ids], most


def assert_same_outputs(got, expected):
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.token_ids == e.token_ids, f"request {i}"
        assert (g.text, g.finish_reason, g.error) == (e.text, e.finish_reason, e.error), f"request {i}"
        assert g.logprobs == e.logprobs, f"request {i}: logprobs"  # bitwise: the same rows, whatever the batch
        assert g.prompt_logprobs == e.prompt_logprobs, f"request {i}: prompt logprobs"


def assert_speculated(eng: LLMEngine, spec_name: str):
    """Proposals were made and verified; accepted and rejected ones where the draft can produce both."""
    s = eng.stats()
    assert s.spec_proposed_tokens > 0 and s.spec_verifications > 0, s
    assert s.spec_accepted_tokens > 0 or spec_name == "draft-other", s
    assert s.spec_accepted_tokens < s.spec_proposed_tokens, s


def assert_nothing_held(eng: LLMEngine):
    assert not eng.has_unfinished() and not eng.requests
    assert eng.block_manager.num_used_blocks == 0
    proposer = eng.speculator.proposer
    if hasattr(proposer, "num_used_blocks"):  # a draft model's own cache
        assert proposer.num_used_blocks == 0


# --- greedy, one request at a time ----------------------------------------------------------------------------


def alone_prompts(tokenizer) -> list[list[int]]:
    rng = random.Random(7)
    return [repeating_prompt(rng, n) for n in (50, 33, 21, 9, 4)] + [
        tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the cat sat on the"),
        [rng.randrange(3, 399) for _ in range(30)],
    ]


@pytest.mark.parametrize("spec_name", ["ngram", "ngram-1", "draft-f32", "draft-other"])
def test_greedy_alone_equals_no_speculation(target, drafts, spec_name):
    params = SamplingParams(max_tokens=64, **GREEDY)
    ps = alone_prompts(target[1])
    reference = make_engine(target, drafts)
    expected = [reference.generate([p], params)[0] for p in ps]
    eng = make_engine(target, drafts, SPECS[spec_name])
    got = [drive(eng, [p], [params])[0][0] for p in ps]
    assert_same_outputs(got, expected)
    assert_speculated(eng, spec_name)
    s = eng.stats()
    if spec_name == "draft-f32":  # the same weights: most proposals are the target's own tokens
        assert s.spec_accepted_tokens > 0.5 * s.spec_proposed_tokens, s
    if spec_name == "draft-other":  # an unrelated model: next to none are
        assert s.spec_accepted_tokens < 0.1 * s.spec_proposed_tokens, s
    assert_nothing_held(eng)


def test_a_draft_that_is_the_target_itself_has_every_proposal_accepted(target, drafts):
    """The draft's greedy tokens are computed by the same kernels from the same weights (batch invariance): each
    is the target's own greedy draw, so verification keeps all of them, and each step gives 1 + num_tokens
    tokens."""
    params = SamplingParams(max_tokens=61, **GREEDY)
    ps = alone_prompts(target[1])
    reference = make_engine(target, drafts)
    expected = [reference.generate([p], params)[0] for p in ps]
    eng = make_engine(target, drafts, SPECS["draft-copy"])
    got, most = [], 0
    for p in ps:
        (out,), m = drive(eng, [p], [params])
        got.append(out)
        most = max(most, m)
    assert_same_outputs(got, expected)
    s = eng.stats()
    assert s.spec_proposed_tokens > 0 and s.spec_accepted_tokens == s.spec_proposed_tokens, s
    assert most == 1 + SPECS["draft-copy"]["num_tokens"]
    # 60 tokens after the first: 12 steps of 4 proposals + 1, each proposal capped to what max_tokens leaves
    assert s.spec_verifications == len(ps) * 12
    assert_nothing_held(eng)


# --- a batch of 16 mixed requests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batch(target, drafts):
    ps = batch_prompts(target[1])
    return ps, mixed_params(*stop_settings(target, drafts, ps))


@pytest.fixture(scope="module")
def batch_reference(target, drafts, batch):
    """options name -> the batch's outputs without speculation."""
    ps, params = batch
    cache = {}

    def get(options_name):
        if options_name not in cache:
            eng = make_engine(target, drafts, **OPTIONS[options_name])
            cache[options_name] = eng.generate(ps, params)
        return cache[options_name]

    return get


def test_the_batch_reaches_its_stop_string_stop_token_and_schema(batch_reference):
    out = batch_reference("default")
    assert out[7].finish_reason == "stop" and 0 < len(out[7].token_ids) < 60  # the stop string
    assert out[8].finish_reason == "stop" and 0 < len(out[8].token_ids) < 60  # the stop token
    assert out[13].finish_reason == "stop"
    json.loads(out[13].text)
    assert [len(o.token_ids) for o in out[:4]] == [40, 1, 2, 17]


@pytest.mark.parametrize("options_name", list(OPTIONS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_a_mixed_batch_equals_no_speculation(target, drafts, batch, batch_reference, spec_name, options_name):
    ps, params = batch
    expected = batch_reference(options_name)
    eng = make_engine(target, drafts, SPECS[spec_name], **OPTIONS[options_name])
    got, most = drive(eng, ps, params)
    assert_same_outputs(got, expected)
    assert_speculated(eng, spec_name)
    if spec_name != "draft-other":
        assert most > 1  # some step gave a request several tokens
    s = eng.stats()
    if options_name == "preemption":
        assert s.preemptions > 0, s
    if options_name != "no-prefix-cache":
        assert s.prefix_cache_hit_blocks > 0, s
    assert_nothing_held(eng)


# --- ends inside a verification: a complete structured value, a stop string, a stop token, the context ----------


@pytest.mark.parametrize("spec_name", ["ngram", "ngram-1", "draft-copy", "draft-f32"])
def test_json_schema_requests_equal_no_speculation(target, drafts, spec_name):
    """Proposals are cut where the grammar refuses them, and verification draws within the grammar; a value that is
    complete at a token inside a verification ends the request at that token, its closing brace included."""
    rng = random.Random(8)
    ps = [repeating_prompt(rng, rng.randrange(2, 40)) for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=60, json_schema=PERSON) if i % 2 else
              SamplingParams(temperature=0.5, seed=i, max_tokens=60, json_schema=PERSON) for i in range(24)]
    expected = make_engine(target, drafts).generate(ps, params)
    assert all(o.finish_reason == "stop" for o in expected)
    eng = make_engine(target, drafts, SPECS[spec_name])
    got = drive(eng, ps, params)[0]
    assert_same_outputs(got, expected)
    assert_speculated(eng, spec_name)
    assert_nothing_held(eng)


@pytest.mark.parametrize("spec_name", ["ngram-1", "draft-copy"])
def test_stop_strings_and_stop_tokens_inside_a_verification(target, drafts, spec_name):
    """Stop strings and stop tokens that the greedy outputs reach at various positions: with the target's own copy
    as the draft each step verifies 4 proposals, so most stops fall inside a verification, and the tokens
    verification drew after them must not be output."""
    rng = random.Random(9)
    ps = [repeating_prompt(rng, rng.randrange(5, 40)) for _ in range(10)]
    free = make_engine(target, drafts).generate(ps, SamplingParams(max_tokens=40, **GREEDY))
    params = []
    for i, out in enumerate(free):
        token = out.token_ids[5 + i * 3]
        text = out.text
        stop = next((text[j : j + 2] for j in range(len(text) // 4 + i, len(text)) if text[j : j + 2].isalpha()), "zz")
        params.append(SamplingParams(max_tokens=40, stop_token_ids=[token], **GREEDY))
        params.append(SamplingParams(max_tokens=40, stop=[stop], **GREEDY))
    expected = make_engine(target, drafts).generate([p for p in ps for _ in range(2)], params)
    assert sum(o.finish_reason == "stop" for o in expected) >= 15
    eng = make_engine(target, drafts, SPECS[spec_name])
    got = drive(eng, [p for p in ps for _ in range(2)], params)[0]
    assert_same_outputs(got, expected)
    assert eng.stats().spec_accepted_tokens > 0
    assert_nothing_held(eng)


@pytest.mark.parametrize("spec_name", ["ngram-1", "draft-copy", "draft-f32"])
def test_requests_at_the_end_of_the_context(target, drafts, spec_name):
    """max_tokens beyond the context is cut to what the context leaves: proposals never pass it, in the target
    nor in the draft's own cache."""
    context = target[0].config.context_length
    rng = random.Random(10)
    ps = [repeating_prompt(rng, context - n) for n in (2, 3, 5, 9, 17, 30)]
    params = SamplingParams(max_tokens=100, **GREEDY)
    expected = make_engine(target, drafts).generate(ps, params)
    assert [len(o.token_ids) for o in expected] == [2, 3, 5, 9, 17, 30]
    eng = make_engine(target, drafts, SPECS[spec_name])
    assert_same_outputs(drive(eng, ps, [params] * len(ps))[0], expected)
    assert eng.stats().spec_proposed_tokens > 0
    assert_nothing_held(eng)


# --- prefix cache: blocks filled by accepted proposals -----------------------------------------------------------


@pytest.mark.parametrize("spec_name", ["ngram-1", "draft-f32"])
def test_prefix_cache_hits_on_blocks_that_verified_tokens_filled(target, drafts, spec_name):
    """A second turn whose prompt is the first turn's prompt and output hits the blocks the first turn's decoding
    committed, accepted proposals' K/V among them: it must equal the same second turn on an engine without a
    cache (any wrong K/V of an accepted or rejected proposal in a cached block would change it)."""
    rng = random.Random(11)
    first = repeating_prompt(rng, 40)
    params = SamplingParams(max_tokens=64, **GREEDY)
    eng = make_engine(target, drafts, SPECS[spec_name], block_size=4)
    turn1 = drive(eng, [first], [params])[0][0]
    accepted_in_turn1 = eng.stats().spec_accepted_tokens
    second = first + turn1.token_ids + repeating_prompt(rng, 6)
    hits_before = eng.stats().prefix_cache_hit_blocks
    turn2 = drive(eng, [second, first], [params, params])[0]
    s = eng.stats()
    assert accepted_in_turn1 > 0, s  # turn 1's cached blocks hold accepted proposals
    # every full block of turn 1's prompt and output (its last token's K/V were never computed), and of the
    # repeated first prompt all but the block of its last token (which must run to give logits)
    assert s.prefix_cache_hit_blocks - hits_before == (len(first) + 63) // 4 + (len(first) - 1) // 4, s
    assert turn2[0].metrics.cached_prompt_tokens >= len(first) + 60
    expected = make_engine(target, drafts, block_size=4, enable_prefix_caching=False).generate([first, second, first], params)
    assert_same_outputs([turn1, *turn2], [expected[0], expected[1], expected[2]])
    assert_nothing_held(eng)


# --- seeded sampling ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_name", ["ngram-1", "draft-copy", "draft-f32"])
def test_seeded_sampling_gives_the_same_tokens(target, drafts, spec_name):
    rng = random.Random(3)
    ps = [repeating_prompt(rng, n) for n in (48, 30, 24, 16, 10, 6, 40, 20)]
    # low temperatures too: the random model's distribution is flat, so at 0.9 few draws equal a proposal
    params = [SamplingParams(temperature=t, top_p=0.95, seed=100 + i, max_tokens=48, ignore_eos=True)
              for i, t in enumerate([0.9, 0.9, 0.9, 0.9, 0.5, 0.5, 0.2, 0.2])]
    expected = make_engine(target, drafts).generate(ps, params)
    eng = make_engine(target, drafts, SPECS[spec_name])
    got = drive(eng, ps, params)[0]
    assert_same_outputs(got, expected)
    assert_speculated(eng, spec_name)
    # and each request alone, with speculation: the same again
    alone = [drive(eng, [p], [sp])[0][0] for p, sp in zip(ps[:3], params[:3])]
    assert_same_outputs(alone, expected[:3])
    assert_nothing_held(eng)


# --- LoRA ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_name", ["ngram-1", "draft-f32"])
def test_requests_with_a_lora_adapter_equal_no_speculation(tiny_llama_q8, tiny_llama_dir, drafts, tmp_path, spec_name):
    """The draft proposes from its own weights, without the adapter; verification draws from the target with the
    request's adapter, so the output is the adapter's output without speculation."""
    adapter = make_peft_adapter(tiny_llama_dir, tmp_path / "lora", rank=4, seed=1, std=0.2)
    rng = random.Random(12)
    ps = [p for p in (repeating_prompt(rng, n) for n in (40, 25, 12)) for _ in range(2)]
    params = [SamplingParams(max_tokens=40, lora=None if i % 2 else "a", **GREEDY) for i in range(6)]
    params.append(SamplingParams(temperature=0.5, seed=3, max_tokens=40, ignore_eos=True, lora="a"))
    ps.append(ps[0])
    runs = []
    for spec in (None, SPECS[spec_name]):
        eng = make_engine(load_model(tiny_llama_q8)[:2], drafts, spec)  # an engine with adapters owns its model's slots
        eng.add_lora("a", adapter)
        runs.append((drive(eng, ps, params)[0], eng))
    (expected, _), (got, eng) = runs
    assert expected[0].token_ids != expected[1].token_ids  # the adapter changes the output
    assert_same_outputs(got, expected)
    assert_speculated(eng, spec_name)
    assert_nothing_held(eng)


# --- streaming --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_name", ["ngram-1", "draft-copy"])
def test_stream_yields_one_delta_per_token_and_the_text_of_generate(target, drafts, spec_name):
    rng = random.Random(5)
    ps = [repeating_prompt(rng, 30), target[1].encode("the cat sat on the mat. the cat sat on the")]
    for p in ps:
        for params in [SamplingParams(max_tokens=50, logprobs=1, **GREEDY),
                       SamplingParams(temperature=0.3, seed=9, max_tokens=50, ignore_eos=True)]:
            expected = make_engine(target, drafts).generate([p], params)[0]
            eng = make_engine(target, drafts, SPECS[spec_name])
            deltas = list(eng.stream(p, params))
            assert [d.token_id for d in deltas] == expected.token_ids
            assert "".join(d.text for d in deltas) == expected.text
            assert [d.logprob for d in deltas] == (expected.logprobs or [None] * len(deltas))
            assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [expected.finish_reason]
            assert eng.stats().spec_accepted_tokens > 0
            assert_nothing_held(eng)


def test_a_stream_stopped_early_frees_the_blocks_and_draft_blocks(target, drafts):
    eng = make_engine(target, drafts, SPECS["draft-copy"])
    for i, _ in enumerate(eng.stream(repeating_prompt(random.Random(1), 30), SamplingParams(max_tokens=100, **GREEDY))):
        if i == 9:
            break
    assert eng.stats().spec_accepted_tokens > 0
    assert_nothing_held(eng)


# --- no leaks -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_name", ["ngram-1", "draft-f32", "draft-other"])
def test_64_requests_leave_no_blocks_behind(target, drafts, batch, spec_name):
    """64 requests in a tight pool (preemption), with stops, schema, aborts mid-run: afterwards every block of
    the target's and of the draft's cache is back, and the outputs of those that ran to the end are the outputs
    without speculation."""
    _, params16 = batch
    rng = random.Random(64)
    ps = [repeating_prompt(rng, rng.randrange(1, 50)) for _ in range(64)]
    params = [params16[i % 16] for i in range(64)]
    options = OPTIONS["preemption"]
    expected = make_engine(target, drafts, **options).generate(ps, params)
    eng = make_engine(target, drafts, SPECS[spec_name], **options)
    ids = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    aborted = set(ids[5::9])
    outputs, steps = {}, 0
    while eng.has_unfinished():
        for d in eng.step():
            if d.finish_reason is not None:
                outputs[d.request_id] = d.output
        steps += 1
        if steps == 12:
            for i in aborted:
                eng.abort(i)
        bm = eng.block_manager
        for seq in eng.scheduler.running:
            assert len(seq.block_table) <= bm.num_blocks_for(seq.num_tokens), (seq, seq.block_table)
    finished = [k for k, i in enumerate(ids) if i not in aborted or i in outputs]
    assert len(finished) > 50
    assert_same_outputs([outputs[ids[k]] for k in finished], [expected[k] for k in finished])
    assert eng.stats().preemptions > 0
    assert_speculated(eng, spec_name)
    assert_nothing_held(eng)


# --- the adaptive length ------------------------------------------------------------------------------------


def test_the_adaptive_length_stops_proposing_what_is_never_accepted(target, drafts):
    """A prompt of 100 distinct tokens: with ngram_min=1 many output tokens occurred in it, so prompt lookup has a
    proposal (of one token: the agreement is one) at many steps, and the random model seldom continues the prompt.
    Not adaptive, it proposes at every such step; adaptive, after a few rejections it proposes only an occasional
    probe."""
    perm = list(range(3, 399))
    random.Random(2).shuffle(perm)
    prompt = perm[:100]
    params = SamplingParams(max_tokens=150, **GREEDY)
    expected = make_engine(target, drafts).generate([prompt], params)[0]
    verifications = {}
    for adaptive in (False, True):
        eng = make_engine(target, drafts, {**NGRAM_1, "adaptive": adaptive})
        assert_same_outputs(drive(eng, [prompt], [params])[0], [expected])
        s = eng.stats()
        verifications[adaptive] = s.spec_verifications
        assert s.spec_accepted_tokens < 0.2 * s.spec_proposed_tokens, s
    assert verifications[False] > 0.4 * len(expected.token_ids)  # the proposals were there to make
    assert 0 < verifications[True] < 0.1 * len(expected.token_ids), verifications


def test_an_adaptive_draft_as_big_as_the_model_is_never_run(target, drafts):
    # the draft reads as many bytes a token as the model: (k + 1) / (1 + cost * k) <= 1, no proposal can pay, not
    # even all accepted; adaptive, it stays off (no probes) and the output is still the same
    rng = random.Random(4)
    ps = [repeating_prompt(rng, 30), [rng.randrange(3, 399) for _ in range(20)]]
    params = SamplingParams(max_tokens=100, **GREEDY)
    expected = make_engine(target, drafts).generate(ps, params)
    eng = make_engine(target, drafts, {**SPECS["draft-other"], "adaptive": True})
    assert_same_outputs(drive(eng, ps, [params] * 2)[0], expected)
    s = eng.stats()
    generated = sum(len(o.token_ids) for o in expected)
    assert s.spec_proposed_tokens == 0 and generated > 0, s
    assert_nothing_held(eng)


# --- errors -------------------------------------------------------------------------------------------------


def swapped_vocabulary_dir(hf_dir, out):
    """hf_dir's tokenizer files with tokens 100 and 101 trading ids: the same tokens, other numbers."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(hf_dir / name, out / name)
    files = json.loads((out / "tokenizer.json").read_text())
    vocab = files["model"]["vocab"]
    by_id = {i: text for text, i in vocab.items()}
    vocab[by_id[100]], vocab[by_id[101]] = 101, 100
    (out / "tokenizer.json").write_text(json.dumps(files))
    return out


def test_a_draft_with_another_vocabulary_is_a_clear_error(target, drafts, tiny_llama_dir, tmp_path):
    model, tokenizer = target
    other_vocab = from_hf_dir(swapped_vocabulary_dir(tiny_llama_dir, tmp_path))
    with pytest.raises(ValueError, match=r"draft model copy: its vocabulary differs from the target's: token 100 is "):
        LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=4 << 20, speculative=SPECS["draft-copy"]),
                  draft_model=drafts["copy"][0], draft_tokenizer=other_vocab)


def test_llm_refuses_a_draft_model_directory_of_another_vocabulary(tiny_llama_q8, tiny_llama_dir, tmp_path):
    draft_dir = tmp_path / "draft"
    shutil.copytree(tiny_llama_dir, draft_dir)
    swapped_vocabulary_dir(tiny_llama_dir, draft_dir)
    with pytest.raises(ValueError, match=r"its vocabulary differs from the target's: token 100 .* must share the target's tokenizer"):
        LLM(str(tiny_llama_q8), threads=1, kv_cache_memory=4 << 20,
            speculative={"method": "draft", "model": str(draft_dir)})


def test_method_draft_without_a_draft_model_is_an_error(target, drafts):
    model, tokenizer = target
    config = EngineConfig(kv_cache_memory=4 << 20, speculative=SPECS["draft-copy"])
    with pytest.raises(ValueError, match="needs the draft model 'copy'"):
        LLMEngine(model, tokenizer, config)
    with pytest.raises(ValueError, match="needs the draft model 'copy'"):
        LLMEngine(model, tokenizer, config, draft_model=drafts["copy"][0])
    with pytest.raises(ValueError, match="method is not 'draft'"):
        LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=4 << 20, speculative=NGRAM), draft_model=drafts["copy"][0],
                  draft_tokenizer=tokenizer)
