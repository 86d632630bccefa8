"""Speculative decoding's settings, from where users give them to the engine: LLM(speculative=...), the CLI's
--speculative / --num-speculative-tokens, churon serve's catalog (the draft model's memory) and /metrics.

The reference for every output is the same request run without speculation: speculation changes how many steps
an answer takes, never the answer.
"""

import os
import subprocess
import sys

import pytest

from churon import LLM, SamplingParams
from churon.cli import _speculative, build_parser
from churon.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from churon.engine import EngineStats
from churon.errors import ChuronError, TaskError
from churon.server.catalog import ModelCatalog, _file_bytes
from churon.server.metrics import ServerMetrics
from tiny_models import make_hf_model

# a prompt whose continuation a tiny random model tends to loop on, so that prompt lookup finds matches
PROMPT = "one two three four one two three four one two three"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """Another tiny llama with the same tokenizer as tiny_llama_dir (other weights): a draft model for it."""
    return make_hf_model("llama", tmp_path_factory.mktemp("tiny-draft"), seed=1)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(tiny_llama_dir, threads=1)


# --- the CLI's flags ---------------------------------------------------------------------------------------------

COMMANDS = {"run": ["run", "m", "hello"], "chat": ["chat", "m"], "serve": ["serve", "m"]}


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_make_the_speculative_config(command):
    parse = build_parser().parse_args
    args = COMMANDS[command]
    assert _speculative(parse(args)) is None
    assert _speculative(parse([*args, "--speculative", "ngram"])) == SpeculativeConfig("ngram")  # the default K
    assert _speculative(parse([*args, "--speculative", "ngram", "--num-speculative-tokens", "7"])) == \
        SpeculativeConfig("ngram", num_tokens=7)
    # anything but the word ngram is a draft model (a path, a registry name)
    assert _speculative(parse([*args, "--speculative", "./ngram", "--num-speculative-tokens", "2"])) == \
        SpeculativeConfig("draft", num_tokens=2, model="./ngram")
    assert _speculative(parse([*args, "--speculative", "smollm2-135m"])) == \
        SpeculativeConfig("draft", model="smollm2-135m")


@pytest.mark.parametrize("k", ["0", str(MAX_SPECULATIVE_TOKENS + 1), "-1", "four", "2.5"])
def test_a_bad_number_of_speculative_tokens_is_an_argparse_error_naming_the_flag(k, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "m", "hello", "--speculative", "ngram", "--num-speculative-tokens", k])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--num-speculative-tokens" in err and f"[1, {MAX_SPECULATIVE_TOKENS}]" in err


def test_speculative_tokens_without_a_method_is_an_error():
    args = build_parser().parse_args(["run", "m", "hello", "--num-speculative-tokens", "3"])
    with pytest.raises(ValueError, match="--num-speculative-tokens .*--speculative"):
        _speculative(args)


# --- LLM(speculative=...) ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, key", [
    ({"method": "ngram", "num_tokns": 4}, "num_tokns"),
    ({"method": "ngram", "num_tokens": 0}, "num_tokens"),
    ({"method": "ngram", "num_tokens": MAX_SPECULATIVE_TOKENS + 1}, "num_tokens"),
    ({"method": "ngram", "ngram_max": 2, "ngram_min": 3}, "ngram_min"),
    ({"method": "eagle"}, "method"),
    ({"method": "draft"}, "model"),
    ({"method": "ngram", "model": "x.gguf"}, "model"),
    ("ngram", "speculative"),
])
def test_bad_settings_are_a_value_error_naming_the_setting_before_any_load(setting, key, tmp_path):
    # the model does not exist: the settings are refused before it would be opened
    with pytest.raises(ValueError, match=key):
        LLM(tmp_path / "missing.gguf", speculative=setting)


def test_ngram_speculation_keeps_greedy_and_seeded_outputs(tiny_llama_dir, plain):
    llm = LLM(tiny_llama_dir, threads=1, speculative={"method": "ngram", "num_tokens": 4, "ngram_max": 3,
                                                      "adaptive": False})
    assert llm.engine.config.speculative == SpeculativeConfig("ngram", num_tokens=4, ngram_max=3, adaptive=False)
    # a tiny random model seldom repeats itself, so prompt lookup seldom finds anything to propose; one token's
    # bias makes the answer repeat that token, which prompt lookup then proposes (and the model accepts)
    looping = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             logit_bias={plain.tokenizer.encode(PROMPT)[3]: 1000.0})
    for params in (GREEDY, SEEDED, looping):
        expected = plain.generate([PROMPT], params)[0]
        out = llm.generate([PROMPT], params)[0]
        assert out.token_ids == expected.token_ids and out.text == expected.text
    stats = llm.engine.stats()
    assert stats.spec_proposed_tokens > 0 and stats.spec_verifications > 0  # it did speculate
    assert 0 < stats.spec_accepted_tokens <= stats.spec_proposed_tokens


def test_a_draft_model_loads_beside_the_model_and_keeps_its_outputs(tiny_llama_dir, draft_dir, plain):
    llm = LLM(tiny_llama_dir, threads=1, speculative={"method": "draft", "model": str(draft_dir), "num_tokens": 3,
                                                      "adaptive": False})
    for params in (GREEDY, SEEDED):
        assert llm.generate([PROMPT], params)[0].token_ids == plain.generate([PROMPT], params)[0].token_ids
    assert llm.engine.stats().spec_proposed_tokens > 0


def test_the_model_itself_as_its_draft_has_every_proposal_accepted(tiny_llama_dir, plain):
    llm = LLM(tiny_llama_dir, threads=1, speculative={"method": "draft", "model": str(tiny_llama_dir), "num_tokens": 4,
                                                      "adaptive": False})
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == plain.generate([PROMPT], GREEDY)[0].token_ids
    stats = llm.engine.stats()
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens == stats.spec_proposed_tokens


def test_an_encoder_is_no_draft_model(tiny_llama_dir, tiny_bert_dir):
    with pytest.raises(TaskError, match="draft model .*encoder"):
        LLM(tiny_llama_dir, threads=1, speculative={"method": "draft", "model": str(tiny_bert_dir)})


def test_an_embedding_model_takes_no_speculation(tiny_bert_dir):
    with pytest.raises(TaskError, match="speculative decoding is for generating text"):
        LLM(tiny_bert_dir, threads=1, speculative={"method": "ngram"})


# --- churon run --------------------------------------------------------------------------------------------------

def churon(*args):
    result = subprocess.run([sys.executable, "-m", "churon.cli", *map(str, args)], input="", capture_output=True,
                            text=True, timeout=120, env=dict(os.environ))
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_run_speculative_prints_the_same_answer_and_verbose_reports_acceptance(tiny_llama_dir, plain):
    result = churon("run", tiny_llama_dir, PROMPT, "--raw", "--temperature", "0", "--max-tokens", "16", "--threads",
                    "1", "--speculative", "ngram", "--num-speculative-tokens", "3", "--verbose")
    assert result.returncode == 0, result.stderr
    expected = plain.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16))[0]
    assert result.stdout == expected.text + "\n"
    line = next(x for x in result.stderr.splitlines() if x.startswith("speculative (ngram):"))
    for field in ("tokens proposed", "accepted", "mean accepted length"):
        assert field in line


def test_run_without_speculation_reports_none(tiny_llama_dir):
    result = churon("run", tiny_llama_dir, "hello", "--raw", "--temperature", "0", "--max-tokens", "4", "--threads",
                    "1", "--verbose")
    assert result.returncode == 0, result.stderr
    assert "decode:" in result.stderr and "speculative" not in result.stderr


# --- churon serve: the catalog and /metrics ----------------------------------------------------------------------

def test_the_catalog_counts_the_draft_model_in_each_text_model(tiny_llama_dir, draft_dir):
    share = 1 << 40  # the KV cache is max_num_seqs full contexts either way
    without = ModelCatalog(share).plan("m", tiny_llama_dir)
    catalog = ModelCatalog(share, engine_options={"speculative": {"method": "draft", "model": str(draft_dir)}})
    assert catalog.draft_bytes == _file_bytes(draft_dir) > 0
    planned = catalog.plan("m", tiny_llama_dir)
    assert planned.resident_bytes == without.resident_bytes + catalog.draft_bytes
    assert SpeculativeConfig.of(planned.engine_options["speculative"]) == SpeculativeConfig("draft", model=str(draft_dir))
    assert planned.engine_options["kv_cache_memory"] == without.engine_options["kv_cache_memory"]


def test_the_catalog_refuses_a_draft_model_it_cannot_use_at_start(tmp_path, tiny_bert_dir):
    with pytest.raises(ChuronError, match="missing"):
        ModelCatalog(1 << 30, engine_options={"speculative": {"method": "draft", "model": str(tmp_path / "missing")}})
    with pytest.raises(TaskError, match="draft model .*encoder"):
        ModelCatalog(1 << 30, engine_options={"speculative": {"method": "draft", "model": str(tiny_bert_dir)}})
    with pytest.raises(ValueError, match="num_tokens"):
        ModelCatalog(1 << 30, engine_options={"speculative": {"method": "ngram", "num_tokens": 0}})


def _stats(**spec) -> EngineStats:
    return EngineStats(running=1, waiting=0, kv_cache_usage=0.5, prefix_cache_hit_rate=0.0, prefix_cache_hit_blocks=0,
                       prefix_cache_miss_blocks=0, preemptions=0, **spec)


def test_metrics_render_the_speculative_families():
    text = ServerMetrics().render(_stats(spec_proposed_tokens=10, spec_accepted_tokens=7, spec_verifications=4))
    lines = text.splitlines()
    for name, kind, value in [
        ("churon_spec_proposed_tokens_total", "counter", "10"),
        ("churon_spec_accepted_tokens_total", "counter", "7"),
        ("churon_spec_verifications_total", "counter", "4"),
        ("churon_spec_acceptance_rate", "gauge", "0.7"),  # 7 / 10
        ("churon_spec_mean_accepted_length", "gauge", "2.75"),  # 1 + 7 / 4
    ]:
        assert f"# TYPE {name} {kind}" in lines and f"{name} {value}" in lines
        assert any(x.startswith(f"# HELP {name} ") for x in lines)


def test_metrics_without_speculation_are_zero_and_absent_while_loading():
    lines = ServerMetrics().render(_stats()).splitlines()
    assert "churon_spec_proposed_tokens_total 0" in lines and "churon_spec_acceptance_rate 0.0" in lines
    assert "churon_spec_mean_accepted_length 0.0" in lines
    assert "churon_spec" not in ServerMetrics().render(None)
