"""benchmarks/replay_speculative.py judges prompt-lookup settings by replaying greedy outputs through the Speculator
instead of timing runs: its counts must be the engine's own. The same requests decoded by the engine with
speculation, one at a time: as many decoding steps, proposed and accepted tokens and verifications as the replay
finds, for adaptive and fixed lengths and n-grams from 1 token; and the oracle proposes exactly what is accepted."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from churon import SamplingParams
from churon.config import EngineConfig, SpeculativeConfig
from churon.engine import LLMEngine
from churon.loader import load_model
from test_speculative_engine import repeating_prompt

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "replay_speculative.py"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def replay_module():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports its sibling benchmarks, as when run
    spec = importlib.util.spec_from_file_location("replay_speculative", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
    sys.path.remove(str(SCRIPT.parent))


@pytest.fixture(scope="module")
def case(tiny_llama_q8):
    """The tiny model, prompts that repeat patterns (prompt lookup finds them) or not, and their greedy outputs."""
    model, tokenizer = load_model(tiny_llama_q8)[:2]
    rng = random.Random(0)
    prompts = [repeating_prompt(rng, n) for n in (60, 40, 24, 12)] + [[rng.randrange(3, 399) for _ in range(30)]]
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=4 << 20))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = [engine.generate([p], params)[0].token_ids for p in prompts]
    return model, tokenizer, prompts, outputs


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_tokens": 4},
    {"method": "ngram", "num_tokens": 8, "adaptive": False},
    {"method": "ngram", "num_tokens": 6, "ngram_min": 1, "ngram_max": 3},
], ids=["adaptive", "fixed", "ngram-1"])
def test_replay_counts_the_engines_steps(replay_module, case, spec):
    model, tokenizer, prompts, outputs = case
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_cache_memory=4 << 20, speculative=spec))
    executes = 0
    execute = engine.runner.execute

    def counted(*args, **kwargs):
        nonlocal executes
        executes += 1
        return execute(*args, **kwargs)

    engine.runner.execute = counted
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, output in zip(prompts, outputs):
        assert engine.generate([prompt], params)[0].token_ids == output
    stats = engine.stats()

    lookup = replay_module.Lookup(SpeculativeConfig(**spec))
    r = replay_module.replay(prompts, outputs, MAX_TOKENS, lambda m: m, lookup)
    assert r.steps == executes - len(prompts)  # one prefill each
    assert (r.proposed, r.accepted, r.steps - r.one_row) == (
        stats.spec_proposed_tokens, stats.spec_accepted_tokens, stats.spec_verifications)
    assert r.accepted > 0 and r.proposed > r.accepted  # speculation happened, and was refused somewhere
    assert r.seconds == r.steps + r.proposed  # each step costed by its rows


def test_oracle_proposes_exactly_what_is_accepted(replay_module, case):
    _, _, prompts, outputs = case
    for n in (2, 1, 0):
        oracle = replay_module.Oracle(n, 8, prompts, outputs)
        r = replay_module.replay(prompts, outputs, MAX_TOKENS, lambda m: m, oracle)
        assert r.proposed == r.accepted > 0
    # a hand case: the last 2 tokens (5, 6) occurred before, followed by 7 8 9; the output goes on 7 8 1
    assert replay_module.longest_continuation([5, 6, 7, 8, 9, 5, 6], [7, 8, 1], 2, 8) == 2
    assert replay_module.longest_continuation([5, 6, 7, 8, 9, 5, 6], [7, 8, 1], 2, 1) == 1
    assert replay_module.longest_continuation([5, 6, 7, 8, 9, 4, 6], [7, 8, 1], 2, 8) == 0  # no occurrence of 4 6
    assert replay_module.longest_continuation([5, 6, 7, 8, 9, 4, 6], [7, 8, 1], 1, 8) == 2  # of 6 alone
    assert replay_module.longest_continuation([5, 6, 7, 8, 9, 4, 6], [8, 9, 4], 0, 8) == 3  # anywhere
