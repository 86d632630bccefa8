"""Sliding-window memory: windowed layers keep their K/V in KV groups of their own (model/kv_layout.py) whose blocks
behind the window go back to the pool as a sequence grows (engine/block_manager.py). What is checked: the grouping
of real models' layer patterns, the blocks a windowed sequence holds staying bounded while it decodes past several
windows, its outputs equal to the run that keeps every block (the same model on a cache for one sequence), with
prefix caching, preemption, speculative decoding and a batch of sequences, and the prefix cache's hits in windowed
groups (a hit needs only the blocks its window sees)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from churon import kernels
from churon.config import EngineConfig, ModelConfig
from churon.engine.block_manager import BlockManager
from churon.engine.core import LLMEngine
from churon.engine.kv_cache import SequenceKVCache, kv_bytes_per_token
from churon.engine.memory import plan_memory
from churon.engine.sequence import Sequence
from churon.loader import load_model
from churon.model.kv_layout import KVLayout, blocks_held
from churon.sampling import SamplingParams
from tiny_models import SLIDING_WINDOW, make_hf_model

# five windowed layers to one global; alternating; all windowed; alternating, with attention sinks
WINDOWED_ARCHS = ("gemma3", "gemma2", "mistral", "gpt_oss")


def _config(windows: tuple[int, ...]) -> ModelConfig:
    return ModelConfig(architecture="gemma3", vocab_size=32, hidden_size=16, intermediate_size=32,
                       num_layers=len(windows), num_heads=2, num_kv_heads=1, head_dim=8, context_length=4096,
                       rms_norm_eps=1e-6, rope_theta=1e4, layer_windows=windows)


def test_layouts_of_real_layer_patterns():
    gemma3_270m = _config(tuple(0 if i % 6 == 5 else 512 for i in range(18)))  # 15 windowed, 3 global
    layout = KVLayout.of(gemma3_270m)
    assert layout.group_size == 3 and layout.windows == (0, 512, 512, 512, 512, 512)
    assert layout.groups[0].layers == (5, 11, 17) and layout.groups[1].layers == (0, 1, 2)
    assert layout.groups[2].layers == (3, 4, 6)
    # every layer has one place: its group and index, no two layers in one
    assert sorted(layout.layer_slots) == sorted({(g, i) for g in range(6) for i in range(3)})
    assert layout.layer_slots[11] == (0, 1) and layout.layer_slots[6] == (2, 2)
    gpt_oss = KVLayout.of(_config(tuple(128 if i % 2 == 0 else 0 for i in range(24))))
    assert gpt_oss.group_size == 12 and gpt_oss.windows == (0, 128)
    gemma3_4b = KVLayout.of(_config(tuple(0 if i % 6 == 5 else 1024 for i in range(34))))  # 5 global, 29 windowed
    assert gemma3_4b.group_size == 5 and [len(g.layers) for g in gemma3_4b.groups] == [5, 5, 5, 5, 5, 5, 4]
    mistral = KVLayout.of(_config((4096,) * 4))  # one windowed group of every layer
    assert mistral.windows == (4096,) and mistral.group_size == 4 and mistral.groups[0].layers == (0, 1, 2, 3)
    llama = KVLayout.of(ModelConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                                    num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8, context_length=64,
                                    rms_norm_eps=1e-6, rope_theta=1e4))
    assert llama == KVLayout.whole(3) and llama.layer_slots == ((0, 0), (0, 1), (0, 2))


def test_long_context_costs_the_global_layers_and_a_bounded_rest():
    """The planner counts a windowed group's blocks up to its window: Gemma 3 270M's pattern at 32k context holds
    3 global layers' full history plus 15 layers' 512-token windows, about a sixth of a full-history model's."""
    config = _config(tuple(0 if i % 6 == 5 else 512 for i in range(18)))
    full = kv_bytes_per_token(config, torch.float32) * 32768
    plan = plan_memory(config, 10**6, EngineConfig(kv_cache_memory=10**9), 32768, torch.float32, available=10**10)
    one = plan.sequence_slots(32768) // plan.block_size * plan.block_bytes
    expected = kv_bytes_per_token(config, torch.float32, 3) * (32768 + 5 * (512 + 16))  # a window + its first block
    assert one == expected and one / full == pytest.approx(1 / 6 + 5 / 6 * 528 / 32768)
    # the pool is sized in those blocks: the sequences it holds at 32k are many more than 1 GB / full
    assert 10**9 // one > 4 * (10**9 // full)
    assert blocks_held((0,), 100, 16) == 7 and blocks_held((8,), 100, 4) == 3 and blocks_held((8,), 100, 4, 8) == 5


def _decode(bm: BlockManager, seq: Sequence, steps: int) -> list[int]:
    """Decode `steps` tokens (their ids 1000, 1001, ...), committing each; the blocks held after each step."""
    held = []
    for i in range(steps):
        seq.append_token(1000 + i)
        assert bm.allocate(seq, 1)
        bm.commit(seq, 1)
        held.append(bm.num_held_blocks(seq))
    return held


def _check_refs(bm: BlockManager, seqs) -> None:
    """Every block's count is the number of (unreleased) table entries naming it; free ones are named by none."""
    refs = Counter()
    for s in seqs:
        for g, table in enumerate(s.block_tables):
            refs.update(table[bm._released(s)[g]:])
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id], f"block {block.block_id}"
    assert bm.num_used_blocks == len(refs)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_windowed_blocks_stay_bounded_while_decoding(prefix_caching):
    bm = BlockManager(64, block_size=4, enable_prefix_caching=prefix_caching, windows=(0, 8))
    seq = Sequence(range(10))
    assert bm.allocate(seq, 10)
    bm.commit(seq, 10)
    held = _decode(bm, seq, 60)  # 70 tokens: past eight windows
    windowed = [h - math.ceil((10 + i + 1) / 4) for i, h in enumerate(held)]  # the global group holds every block
    assert max(windowed) == 3 and windowed[-1] <= 3  # the 8 keys behind the next token span at most 3 blocks
    assert len(seq.block_tables[1]) == len(seq.block_tables[0]) == 18  # entries in place, the released unread
    _check_refs(bm, [seq])
    bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 64


def _evict(bm: BlockManager, block_hash: int) -> None:
    """Evict the cached, unused block of that (salted) hash, as a fresh allocation would."""
    block_id = bm.hash_to_block.pop(block_hash)
    bm._evictable.pop(block_id)
    bm.blocks[block_id].hash, bm.blocks[block_id].token_ids = None, ()
    bm._free.append(block_id)


def test_released_blocks_stay_findable_and_a_hit_needs_only_the_window():
    bm = BlockManager(40, block_size=4, windows=(0, 8))
    first = Sequence(range(41))
    assert bm.allocate(first, 41)
    bm.commit(first, 41)
    _decode(bm, first, 20)  # its windowed blocks behind the window go back, still cached
    bm.free(first)
    again = Sequence(range(41))
    assert bm.num_cached_prefix_tokens(again) == 40
    # evict the windowed group's early blocks: a hit still needs only the last ones before position 40
    for i in range(4):
        _evict(bm, again.block_hashes[i] ^ bm._salts[1])
    assert bm.num_cached_prefix_tokens(again) == 40
    assert bm.allocate(again, 1)
    assert again.num_cached_tokens == 40 and bm._released(again) == [0, 8]  # blocks 8, 9 taken in the window group
    _check_refs(bm, [again])
    bm.free(again)
    # a block the window needs missing: the hit ends where the window no longer finds what it needs
    _evict(bm, again.block_hashes[9] ^ bm._salts[1])
    assert bm.num_cached_prefix_tokens(Sequence(range(41))) == 36  # h = 9: the window sees blocks 7, 8


def test_a_windowed_truncation_below_what_was_released_is_an_error():
    bm = BlockManager(32, block_size=4, enable_prefix_caching=False, windows=(8,))
    seq = Sequence(range(30))
    assert bm.allocate(seq, 30)
    bm.commit(seq, 30)
    _decode(bm, seq, 2)
    with pytest.raises(ValueError, match="below blocks its windows gave back"):
        bm.truncate(seq, 8)
    bm.truncate(seq, 31)  # speculative rollback inside the window is fine
    _check_refs(bm, [seq])


def _unbounded_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the model on a cache for one sequence, which keeps every block."""
    cache = SequenceKVCache.for_model(model, len(prompt) + n)
    logits = model(torch.tensor(prompt), 0, cache)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model(torch.tensor(out[-1:]), len(prompt) + len(out) - 1, cache)
    return out


@pytest.fixture(scope="module", params=WINDOWED_ARCHS)
def windowed_model(request, tmp_path_factory):
    hf = make_hf_model(request.param, tmp_path_factory.mktemp(request.param))
    model, tokenizer, _ = load_model(hf, kernels="native" if kernels.native_available() else "reference")
    assert any(model.config.window(i) == SLIDING_WINDOW for i in range(model.config.num_layers))
    return model, tokenizer


GREEDY = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def _engine(windowed_model, **options) -> LLMEngine:
    model, tokenizer = windowed_model
    return LLMEngine(model, tokenizer, EngineConfig(block_size=4, **options))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_engine_outputs_equal_the_unbounded_run_and_windowed_blocks_stay_bounded(windowed_model, prefix_caching):
    model, _ = windowed_model
    prompt = [(7 * i) % 300 + 3 for i in range(30)]
    eng = _engine(windowed_model, enable_prefix_caching=prefix_caching)
    layout = eng.cache.layout
    assert layout.num_groups > 1 or layout.windows == (SLIDING_WINDOW,)
    seq_id = eng.add_request(prompt, GREEDY)
    held = []  # after each step: per group, the blocks the sequence holds
    while eng.has_unfinished():
        eng.step()
        seq = eng.scheduler.get(seq_id)
        if seq is not None:
            held.append([len(t) - r for t, r in zip(seq.block_tables, eng.block_manager._released(seq))])
    # the prompt's step holds its 8 blocks everywhere; from the next on (step k computes position p = 29 + k) a
    # windowed table holds the blocks from the one with the window's first key, p - 7, to p's (2 or 3), a global
    # one every block
    assert held[0] == [8] * layout.num_groups
    for step, blocks in enumerate(held[1:], start=1):
        p = 29 + step
        assert blocks == [p // 4 + 1 - (p - SLIDING_WINDOW + 1) // 4 if w else p // 4 + 1 for w in layout.windows]
        assert all(n <= 3 for n, w in zip(blocks, layout.windows) if w)
    assert len(held) == 59  # the last step finished it
    assert eng.block_manager.num_used_blocks == 0
    eng2 = _engine(windowed_model, enable_prefix_caching=prefix_caching)
    out = eng2.generate([prompt], GREEDY)[0]
    assert out.token_ids == _unbounded_greedy(model, prompt, 60)


def test_engine_batch_with_prefix_hits_and_preemption_equals_the_unbounded_runs(windowed_model):
    """Eight sequences sharing a 24-token prefix in a pool too small for all of them (preemptions), twice: the
    second round's prompts hit the prefix cache in every group. Each output equals its sequence alone, unbounded."""
    model, _ = windowed_model
    prompts = [[5 + (3 * i) % 200 for i in range(24)] + [50 + j, 60 + j, 70 + j] + [9] * j for j in range(8)]
    expected = [_unbounded_greedy(model, p, 40) for p in prompts]
    layout = KVLayout.of(model.config)
    block_bytes = 4 * kv_bytes_per_token(model.config, model.kv_dtype, layout.group_size)
    eng = _engine(windowed_model, kv_cache_memory=block_bytes * 20 * layout.num_groups, max_num_seqs=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for round_ in range(2):
        outs = eng.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected, f"round {round_}"
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_hit_tokens > 0
    assert eng.block_manager.num_used_blocks == 0


def test_engine_speculative_decoding_on_windowed_layers_equals_the_unbounded_run(windowed_model):
    """Prompt lookup on a repeating prompt: proposals verified in every group, the rejected ones' blocks rolled back
    (the tiny models follow the pattern or not: Gemma 3's accepts every proposal, gpt-oss's few)."""
    model, _ = windowed_model
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 4
    eng = _engine(windowed_model, speculative={"method": "ngram", "num_tokens": 4, "ngram_min": 1})
    out = eng.generate([prompt], GREEDY)[0]
    assert out.token_ids == _unbounded_greedy(model, prompt, 60)
    assert eng.stats().spec_proposed_tokens > 0  # verified (accepted, or rejected and rolled back), with windows


def test_inspect_counts_kv_bytes_by_layer_kind(tmp_path, capsys):
    """The tiny Gemma 3 (one global layer, five windowed of 8): a token costs 256 bytes a layer in float32, and a
    2k-token sequence holds the global layer's 2048 tokens plus, per windowed layer, two 16-token blocks."""
    from churon.cli import main

    hf = make_hf_model("gemma3", tmp_path / "gemma3")
    assert main(["inspect", str(hf)]) == 0
    out = capsys.readouterr().out
    assert "global layers (1): 256 bytes a token of context; windowed layers (5): 1,280 bytes" in out
    kib = (2048 + 5 * 32) * 256 / 1024
    assert f"2k (> model context)   {kib:.1f} KiB" in out


def test_a_pool_for_one_sequence_runs_the_longest_request(windowed_model):
    """max_num_seqs=1 sizes the pool for one full context as its prefill holds it (a windowed group keeps its window
    and the whole chunk), so a request up to the context runs: planned with decoding's smaller need, it was
    refused as too long for the cache."""
    model, _ = windowed_model
    eng = _engine(windowed_model, max_num_seqs=1)
    prompt = [5 + i % 200 for i in range(200)]
    out = eng.generate([prompt], SamplingParams(max_tokens=model.config.context_length - 200, ignore_eos=True))[0]
    assert len(out.token_ids) == model.config.context_length - 200
    assert eng.memory_plan.num_blocks == eng.block_manager.num_blocks_held(model.config.context_length, 2048)


def test_a_batch_whose_chunks_disagree_on_their_kv_groups_is_an_error():
    """Every chunk needs a table per KV group, each long enough for its tokens: else a clear error naming the chunk
    (and the short table's length), before any tensor is made."""
    from churon.model.batch import ForwardBatch, SequenceChunk

    ok = SequenceChunk([1, 2, 3, 4, 5], 0, [0, 1], group_tables=[[2, 3]])
    assert ForwardBatch.build([ok], 4).kv_group(1).slot_mapping.tolist() == [8, 9, 10, 11, 12]
    with pytest.raises(ValueError, match="one block table per KV group"):
        ForwardBatch.build([ok, SequenceChunk([1, 2], 0, [4])], 4)
    with pytest.raises(ValueError, match="sequence chunk 0: 5 tokens need more than its 1 blocks"):
        ForwardBatch.build([SequenceChunk([1, 2, 3, 4, 5], 0, [0, 1], group_tables=[[2]])], 4)
