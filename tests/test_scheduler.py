"""Scheduler: FCFS admission, token budget, chunked prefill, preemption, abort — driven by a fake runner.

The fake runner writes each computed token into a fake K/V store at the slot its block
table gives, and "samples" a token from the context it reads back through the block table.
So a wrong block table, a bad prefix hit or a lost token after preemption changes the output.
"""

from __future__ import annotations

import random

import pytest

from churon.engine.block_manager import BlockManager
from churon.engine.scheduler import CacheCapacityError, ScheduledSeq, Scheduler, SchedulerOutput
from churon.engine.sequence import Sequence, SequenceStatus
from churon.sampling import SamplingParams
from test_block_manager import check_invariants


def next_token(context: list[int]) -> int:
    """The fake model: a function of the context only."""
    return (sum((i + 1) * t for i, t in enumerate(context[-8:])) + 3 * len(context)) % 50


class FakeEngine:
    def __init__(self, num_blocks=1000, block_size=4, max_num_seqs=64, max_num_batched_tokens=2048,
                 enable_chunked_prefill=True, enable_prefix_caching=True, check=True, prefill_chunk_tokens=None):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
                               prefill_chunk_tokens=prefill_chunk_tokens)
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.seqs: list[Sequence] = []
        self.check = check
        self.steps: list[list[tuple[int, int, bool]]] = []  # per step: (seq_id, num_tokens, sample)

    def add(self, prompt, max_tokens=8, seq_id=None) -> Sequence:
        seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens), seq_id=seq_id)
        self.sched.add(seq)
        self.seqs.append(seq)
        return seq

    def slot(self, seq: Sequence, t: int) -> int:
        bs = self.bm.block_size
        return seq.block_table[t // bs] * bs + t % bs

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        bs, sched = self.bm.block_size, self.sched
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs and sched.num_running <= sched.max_num_seqs
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        for sc in out.scheduled:
            seq = sc.seq
            assert sc.num_tokens >= 1 and seq.status is SequenceStatus.RUNNING
            assert sc.start == seq.num_computed_tokens and sc.start + sc.num_tokens <= seq.num_tokens
            assert len(seq.block_table) * bs >= sc.start + sc.num_tokens
            admitted = sc.start == seq.num_cached_tokens  # first step after (re)admission
            if not sched.enable_chunked_prefill and admitted and seq.num_tokens - sc.start <= sched.max_num_batched_tokens:
                assert sc.sample, "without chunked prefill a prompt runs whole"
        for seq in out.preempted:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table and seq.num_computed_tokens == 0
        # the forward pass: write K/V of the scheduled tokens, then read contexts back
        for sc in out.scheduled:
            for t in range(sc.start, sc.start + sc.num_tokens):
                assert self.bm.blocks[sc.seq.block_table[t // bs]].ref_count == 1, "write into a shared block"
                self.kv[self.slot(sc.seq, t)] = (t, sc.seq.token_ids[t])
        sampled = {}
        for sc in out.scheduled:
            if sc.sample:
                seq = sc.seq
                context = [self.kv[self.slot(seq, t)] for t in range(seq.num_tokens)]
                assert [p for p, _ in context] == list(range(seq.num_tokens))
                sampled[seq.seq_id] = [next_token([tok for _, tok in context])]
        sched.update_from_output(out, sampled)
        if self.check:
            check_invariants(self.bm, self.seqs)
        self.steps.append([(s.seq.seq_id, s.num_tokens, s.sample) for s in out.scheduled])
        return out

    def run(self, max_steps=10_000) -> dict[int, list[int]]:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "did not finish"
        assert self.bm.num_used_blocks == 0
        return {s.seq_id: s.output_token_ids for s in self.seqs}


def test_fcfs_admission_and_max_num_seqs():
    eng = FakeEngine(max_num_seqs=2)
    for i, n in enumerate([3, 5, 2, 4, 1]):
        eng.add([i] * 3, max_tokens=n, seq_id=i)
    eng.run()
    first_step = {}
    for k, step in enumerate(eng.steps):
        assert len(step) <= 2
        for seq_id, _, _ in step:
            first_step.setdefault(seq_id, k)
    order = sorted(first_step, key=lambda i: (first_step[i], i))
    assert order == [0, 1, 2, 3, 4]
    assert first_step[2] == 3  # admitted when seq 0 (3 tokens) finished
    assert all(s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens for s in eng.seqs)


def test_queue_head_is_not_overtaken():
    eng = FakeEngine(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = eng.add(range(5), seq_id=0)
    b = eng.add(range(10, 15), seq_id=1)
    c = eng.add(range(2), seq_id=2)  # would fit the 3 tokens left, but b is first
    eng.step()
    assert eng.steps[-1] == [(0, 5, True)]
    eng.step()
    assert eng.steps[-1] == [(0, 1, True), (1, 5, True), (2, 2, True)]
    assert [s.status for s in (a, b, c)] == [SequenceStatus.RUNNING] * 3


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_burst_sharing_a_prompt_prefix_computes_it_once(prefix_caching):
    """Requests arriving together with one 20-token system prompt (5 blocks of 4): the first computes it,
    the others wait the one step until its blocks are cached and then compute only their own tokens.
    Without prefix caching nobody waits. Outputs are those of each request alone."""
    system = list(range(100, 120))
    prompts = [system + [i, i + 1, i + 2] for i in range(6)]
    alone = []
    for i, prompt in enumerate(prompts):
        single = FakeEngine(enable_prefix_caching=prefix_caching)
        single.add(prompt, max_tokens=3, seq_id=i)
        alone.append(single.run()[i])
    eng = FakeEngine(enable_prefix_caching=prefix_caching)
    for i, prompt in enumerate(prompts):
        eng.add(prompt, max_tokens=3, seq_id=i)
    outputs = eng.run()
    assert [outputs[i] for i in range(6)] == alone
    if prefix_caching:
        assert eng.steps[0] == [(0, 23, True)]
        assert eng.steps[1] == [(0, 1, True)] + [(i, 3, True) for i in range(1, 6)]  # 20 tokens from the cache
        assert sum(n for step in eng.steps for _, n, _ in step) == 23 + 5 * 3 + 6 * 2
    else:
        assert eng.steps[0] == [(i, 23, True) for i in range(6)]


def test_a_prefix_shared_with_a_decoding_sequence_is_not_waited_for():
    eng = FakeEngine()
    eng.add(list(range(100, 120)) + [1], max_tokens=4, seq_id=0)
    eng.step()
    eng.add(list(range(100, 120)) + [2], max_tokens=4, seq_id=1)  # seq 0's prompt blocks are cached
    eng.step()
    assert eng.steps[-1] == [(0, 1, True), (1, 1, True)]


def test_limits_respected_on_a_random_workload():
    rng = random.Random(0)
    eng = FakeEngine(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=16)
    for i in range(20):
        eng.add([rng.randrange(50) for _ in range(rng.randint(1, 40))], max_tokens=rng.randint(1, 12), seq_id=i)
    eng.run()  # FakeEngine.step checks budget, max_num_seqs and non-empty chunks every step
    mixed = [s for s in eng.steps if any(n > 1 for _, n, _ in s) and any(n == 1 and smp for _, n, smp in s)]
    assert mixed, "no step mixed a prefill chunk with decodes"
    assert all(sum(n for _, n, _ in s) <= 16 for s in eng.steps)


def test_chunked_prefill_splits_long_prompts_and_mixes_with_decodes():
    eng = FakeEngine(max_num_batched_tokens=16)
    eng.add(range(4), max_tokens=10, seq_id=0)
    eng.step()
    eng.add(range(100, 140), max_tokens=3, seq_id=1)  # 40 tokens
    for _ in range(4):
        eng.step()
    assert eng.steps == [
        [(0, 4, True)],
        [(0, 1, True), (1, 15, False)],
        [(0, 1, True), (1, 15, False)],
        [(0, 1, True), (1, 10, True)],
        [(0, 1, True), (1, 1, True)],
    ]


def test_a_burst_gets_its_first_tokens_in_arrival_order_a_chunk_a_step():
    """Six 40-token prompts at once, chunks of 64 prompt tokens a step: the first token of each comes in
    arrival order, a step or two apart, while the ones already started decode every step; the outputs are
    those of each request alone."""
    prompts = [list(range(10 * i, 10 * i + 40)) for i in range(6)]
    alone = []
    for i, prompt in enumerate(prompts):
        single = FakeEngine(prefill_chunk_tokens=64)
        single.add(prompt, max_tokens=12, seq_id=i)
        alone.append(single.run()[i])
        assert single.steps[0] == [(i, 40, True)]  # alone in the engine: the whole prompt in one step
    eng = FakeEngine(prefill_chunk_tokens=64)
    for i, prompt in enumerate(prompts):
        eng.add(prompt, max_tokens=12, seq_id=i)
    outputs = eng.run()
    assert [outputs[i] for i in range(6)] == alone
    assert eng.steps[0] == [(0, 40, True), (1, 24, False)]
    assert eng.steps[1] == [(0, 1, True), (1, 16, True), (2, 40, True), (3, 8, False)]
    first_token = {}
    for k, step in enumerate(eng.steps):
        prompt_tokens = sum(n for seq_id, n, _ in step if n > 1 or len(eng.seqs[seq_id].prompt_token_ids) == 1)
        assert prompt_tokens <= 64
        for seq_id, _, sample in step:
            if sample:
                first_token.setdefault(seq_id, k)
    assert [first_token[i] for i in range(6)] == [0, 1, 1, 2, 3, 3]
    # every started request decodes in every step until it ends: no step of prompts alone holds it back
    for seq_id in range(6):
        ran = [k for k, step in enumerate(eng.steps) if any(s == seq_id for s, _, _ in step)]
        assert ran == list(range(ran[0], ran[-1] + 1))


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    eng = FakeEngine(max_num_batched_tokens=16, enable_chunked_prefill=False)
    eng.add(range(10), seq_id=0)
    eng.add(range(20, 30), seq_id=1)
    eng.step()
    eng.step()
    assert eng.steps == [[(0, 10, True)], [(0, 1, True), (1, 10, True)]]
    assert not eng.sched.can_ever_fit(17)
    assert eng.sched.can_ever_fit(100, num_prompt_tokens=16)
    eng.add(range(200, 217), seq_id=2)
    with pytest.raises(CacheCapacityError, match="max_num_batched_tokens"):
        for _ in range(20):
            eng.step()


def _workload(seed: int, n: int = 32):
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(12)]
    out = []
    for _ in range(n):
        prompt = shared[: rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
        out.append((prompt, rng.randint(5, 30)))
    return out


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_in_a_tiny_pool_gives_the_same_outputs(chunked, prefix_caching):
    work = _workload(1)
    reference = FakeEngine(num_blocks=1000, enable_chunked_prefill=chunked, enable_prefix_caching=prefix_caching, check=False)
    tiny = FakeEngine(num_blocks=14, max_num_batched_tokens=24, enable_chunked_prefill=chunked,
                      enable_prefix_caching=prefix_caching)
    for i, (prompt, max_tokens) in enumerate(work):
        assert tiny.sched.can_ever_fit(len(prompt) + max_tokens, num_prompt_tokens=len(prompt))
        reference.add(prompt, max_tokens, seq_id=i)
        tiny.add(prompt, max_tokens, seq_id=i)
    expected = reference.run()
    assert tiny.run() == expected
    assert reference.sched.num_preemptions == 0 and tiny.sched.num_preemptions > 0
    assert all(s.finish_reason == "length" and s.num_output_tokens == s.params.max_tokens for s in tiny.seqs)
    if prefix_caching:
        assert tiny.bm.num_hit_blocks > 0


def test_preemption_takes_the_most_recent_and_requeues_it_first():
    eng = FakeEngine(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = eng.add(range(4), max_tokens=3, seq_id=0)
    b = eng.add(range(10, 14), max_tokens=3, seq_id=1)
    c = eng.add([7], max_tokens=1, seq_id=2)
    out = eng.step()  # a and b take all four blocks, c waits
    assert eng.steps[-1] == [(0, 4, True), (1, 4, True)] and not out.preempted
    out = eng.step()  # a needs a third block: b is preempted, nobody is admitted
    assert out.preempted == [b] and eng.steps[-1] == [(0, 1, True)]
    assert list(eng.sched.waiting) == [b, c] and b.num_output_tokens == 1 and b.num_uncomputed_tokens == 5
    assert eng.sched.num_preemptions == 1
    eng.step()  # a finishes (3 tokens)
    assert a.is_finished
    eng.step()  # b recomputes prompt + its generated token in one go; c fits beside it
    assert eng.steps[-1] == [(1, 5, True), (2, 1, True)]
    eng.run()
    assert b.output_token_ids[:1] == [next_token(list(range(10, 14)))]


def test_a_lone_sequence_that_outgrows_the_pool_is_an_error():
    eng = FakeEngine(num_blocks=2, block_size=2)
    assert eng.sched.can_ever_fit(4) and not eng.sched.can_ever_fit(5)
    eng.add(range(3), max_tokens=5)
    with pytest.raises(CacheCapacityError, match="can never run"):
        for _ in range(10):
            eng.step()
    eng = FakeEngine(num_blocks=2, block_size=2)
    eng.add(range(10), max_tokens=1)
    with pytest.raises(CacheCapacityError, match="can never run"):
        eng.step()


def test_abort_running_frees_blocks_at_once():
    eng = FakeEngine(num_blocks=10, block_size=4)
    a = eng.add(range(6), max_tokens=5, seq_id=0)
    b = eng.add(range(50, 59), max_tokens=5, seq_id=1)
    eng.step()
    eng.step()
    held = len(b.block_table)
    assert held == 3
    free_before = eng.bm.num_free_blocks
    assert eng.sched.abort(1)
    assert eng.bm.num_free_blocks == free_before + held
    assert b.is_finished and b.finish_reason == "abort" and b.block_table == []
    assert eng.sched.running == [a] and eng.sched.get(1) is None
    assert not eng.sched.abort(1) and not eng.sched.abort(12345)
    eng.run()
    assert all(sid == 0 for step in eng.steps[2:] for sid, _, _ in step)
    assert a.finish_reason == "length"


def test_abort_waiting():
    eng = FakeEngine(max_num_seqs=1)
    a = eng.add(range(3), max_tokens=4, seq_id=0)
    b = eng.add(range(3), max_tokens=4, seq_id=1)
    eng.step()
    assert eng.sched.num_running == 1 and eng.sched.num_waiting == 1
    assert eng.sched.abort(1)
    assert eng.sched.num_waiting == 0 and b.is_finished and b.finish_reason == "abort"
    assert eng.sched.has_unfinished()
    eng.run()
    assert a.num_output_tokens == 4 and b.num_output_tokens == 0


def test_finish_and_add_errors():
    bm = BlockManager(8)
    sched = Scheduler(bm)
    seq = Sequence([1, 2, 3], seq_id=7)
    sched.add(seq)
    with pytest.raises(ValueError, match="added twice"):
        sched.add(seq)
    sched.finish(seq, "stop")
    assert seq.is_finished and seq.finish_reason == "stop" and not sched.has_unfinished()
    with pytest.raises(ValueError, match="not scheduled here"):
        sched.finish(seq, "stop")
    assert sched.schedule().is_empty
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(bm, max_num_seqs=0)


def test_scheduled_seq_records_start_and_sample():
    seq = Sequence(range(10))
    seq.num_computed_tokens = 4
    first = ScheduledSeq(seq, 3)
    last = ScheduledSeq(seq, 6)
    assert (first.start, first.sample) == (4, False)
    assert (last.start, last.sample) == (4, True)


def test_update_from_output_commits_appends_and_finishes_on_stop_tokens_and_max_tokens():
    bm = BlockManager(16, block_size=4)
    sched = Scheduler(bm)
    stops = Sequence([1, 2, 3, 4, 5], SamplingParams(max_tokens=8, stop_token_ids=[40]), seq_id=0, eos_token_ids=[41])
    short = Sequence([5, 6, 7, 8, 9], SamplingParams(max_tokens=8), seq_id=1, max_tokens=2)  # what the context leaves
    eos_ignored = Sequence([9, 9], SamplingParams(max_tokens=8, ignore_eos=True), seq_id=2, eos_token_ids=[41])
    for seq in (stops, short, eos_ignored):
        sched.add(seq)
    out = sched.schedule()
    assert [s.num_tokens for s in out.scheduled] == [5, 5, 2]
    sched.update_from_output(out, {0: [7], 1: [7], 2: [41]})
    assert [s.num_computed_tokens for s in (stops, short, eos_ignored)] == [5, 5, 2]
    assert bm.num_cached_prefix_tokens(Sequence([1, 2, 3, 4, 5, 6])) == 4  # the full block went to the cache
    assert stops.output_token_ids == [7] and eos_ignored.output_token_ids == [41] and short.output_token_ids == [7]
    assert not any(s.is_finished for s in (stops, short, eos_ignored))

    out = sched.schedule()
    sched.update_from_output(out, {0: [41], 1: [8], 2: [40]})  # the model's EOS; max_tokens reached; a token like any other
    assert stops.is_finished and stops.finish_reason == "stop" and stops.output_token_ids == [7]  # not appended
    assert short.is_finished and short.finish_reason == "length" and short.output_token_ids == [7, 8]
    assert not eos_ignored.is_finished and eos_ignored.output_token_ids == [41, 40]
    assert not stops.block_table and not short.block_table and sched.running == [eos_ignored]

    out = sched.schedule()
    sched.update_from_output(out, {})  # nothing sampled: the tokens still count as computed
    assert eos_ignored.num_computed_tokens == 4 and eos_ignored.output_token_ids == [41, 40]

