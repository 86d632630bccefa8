"""Structured output: decoding constrained to JSON valid against a schema (llguidance).

A tiny random model is a good adversary: left alone it writes anything, so every valid
output below is the mask's doing.
"""

import json

import jsonschema
import pytest
import torch

from churon import LLM, SamplingParams
from churon.config import EngineConfig
from churon.engine import LLMEngine
from churon.loader import load_model
from churon.sampling import Sampler
from churon.tokenizer import from_gguf, from_hf_dir
from churon.engine.kv_cache import SequenceKVCache
from tiny_models import make_hf_model, write_gguf

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def model_and_tokenizer(hf_dir, tmp_path_factory):
    model, tokenizer, _ = load_model(write_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / "m.gguf", "Q8_0"))
    return model, tokenizer


@pytest.fixture
def engine(model_and_tokenizer) -> LLMEngine:
    model, tokenizer = model_and_tokenizer
    return LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=4 << 20))


def test_sampled_output_is_valid_json_for_the_schema(engine):
    prompt = engine.tokenizer.encode("Reply in JSON:")
    free = engine.generate([prompt], SamplingParams(temperature=1, seed=0, max_tokens=40))[0]
    with pytest.raises(ValueError):
        json.loads(free.text)  # unconstrained, the model writes no JSON
    params = [SamplingParams(temperature=1, seed=seed, max_tokens=80, json_schema=PERSON) for seed in range(6)]
    outs = engine.generate([prompt] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop"  # the object closed, not the token limit
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({o.text for o in outs}) > 1  # the seeds still choose
    # the mask depends on the request alone: each one run by itself gives the same text
    assert [engine.generate([prompt], [p])[0].text for p in params[:3]] == [o.text for o in outs[:3]]


def test_json_object_mode_gives_an_object(engine):
    params = [SamplingParams(temperature=1, seed=seed, max_tokens=200, json_schema={"type": "object"}) for seed in range(8)]
    outs = engine.generate([[5, 6, 7]] * len(params), params)
    # "any object" bounds nothing: the random model sometimes writes one endless string
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 3
    assert all(o.text.startswith("{") for o in outs)
    objects = [json.loads(o.text) for o in finished]
    assert all(isinstance(obj, dict) for obj in objects) and any(objects)


def test_constrained_logprobs_are_the_models_raw_ones(engine):
    prompt = [5, 6, 7, 8]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=80, json_schema=PERSON, logprobs=1))[0]
    model = engine.model
    tokens = prompt + out.token_ids
    logits = model(torch.tensor(tokens), 0, SequenceKVCache.for_model(model, len(tokens)), all_logits=True)
    expected = torch.log_softmax(logits[:, : model.config.vocab_size].float(), dim=-1)
    for i, entry in enumerate(out.logprobs):
        assert entry.logprob == pytest.approx(expected[len(prompt) - 1 + i, entry.token_id].item(), abs=1e-3)
    # the grammar forced tokens the model did not rank first
    assert any(e.top[0][0] != e.token_id for e in out.logprobs)


def test_allowed_mask_limits_the_draw_after_bias_and_before_temperature():
    allowed = torch.tensor([False, False, True, True])
    # greedy: the best allowed token, with the bias applied first
    sampler = Sampler(SamplingParams(temperature=0, logit_bias={3: 1.0}), 4, [])
    assert sampler(torch.tensor([5.0, 4.0, 1.0, 0.5]), allowed) == 3
    sampler = Sampler(SamplingParams(temperature=2.0, seed=0), 4, [])
    assert {sampler(torch.tensor([5.0, 4.0, 1.0, 0.5]), allowed) for _ in range(200)} == {2, 3}


@pytest.mark.parametrize(
    "schema, problem",
    [
        ({"type": "foo"}, "Invalid type"),
        ({"$ref": "#/definitions/missing"}, "does not exist"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "Unsatisfiable"),
        ({"type": "string", "pattern": "("}, "regex"),
    ],
)
def test_an_invalid_schema_is_rejected_before_anything_is_queued(engine, schema, problem):
    with pytest.raises(ValueError, match=f"invalid json_schema: .*{problem}"):
        engine.add_request([5, 6, 7], SamplingParams(json_schema=schema))
    assert not engine.has_unfinished()


def test_json_schema_must_be_a_dict():
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema='{"type": "object"}')


def test_token_bytes_join_to_the_text(model_and_tokenizer, hf_dir, tmp_path):
    """llguidance matches the grammar on token bytes: they must be exactly what the text is made of."""
    _, gguf_tokenizer = model_and_tokenizer
    text = "The dog, 42 héllo ✓"
    hf_tokenizer = from_hf_dir(hf_dir)
    for tokenizer in (gguf_tokenizer, hf_tokenizer):  # byte-level BPE from a GGUF table, and from tokenizer.json
        ids = tokenizer.encode(text, add_bos=False)
        assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
        im_end = tokenizer.token_to_id("<|im_end|>")
        assert tokenizer.token_bytes(im_end) == b"<|im_end|>"
        assert tokenizer.token_bytes(tokenizer.vocab_size) == b""
    # SentencePiece: "▁" is a space, <0xAB> byte-fallback tokens their byte
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "h", "i", "\u2581h", "\u2581hi", "é"]
    spm = from_gguf({
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 6,
    })
    ids = spm.encode("hi hé ✓", add_bos=False)
    assert [spm.token_bytes(i) for i in ids] == [b" hi", b" h", "é".encode(), b" ", b"\xe2", b"\x9c", b"\x93"]  # "✓"
    spm_dir = tmp_path / "spm"
    spm_dir.mkdir()
    (spm_dir / "tokenizer.json").write_text(spm._hf.to_str())  # the same tokenizer as a tokenizer.json
    spm_hf = from_hf_dir(spm_dir)
    assert [spm_hf.token_bytes(i) for i in range(len(tokens))] == [spm.token_bytes(i) for i in range(len(tokens))]


@pytest.mark.slow
def test_smollm2_answers_a_chat_with_the_schema(smollm2_gguf):
    llm = LLM(smollm2_gguf)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Make up a person. Give their name and age as JSON."}]
    for params in [SamplingParams(temperature=0, max_tokens=60, json_schema=schema)] + [
        SamplingParams(temperature=0.8, seed=seed, max_tokens=60, json_schema=schema) for seed in range(3)
    ]:
        out = llm.chat(messages, params)
        assert out.finish_reason == "stop"
        person = json.loads(out.text)
        jsonschema.validate(person, schema)
        assert person["name"].strip() and 0 <= person["age"] < 130
