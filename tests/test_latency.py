"""The engine's own latency record (engine/latency.py): nearest-rank percentiles, and what an engine run records."""

import math

import pytest

from churon import LLM, SamplingParams, kernels
from churon.engine.latency import PERCENTILES, LatencyWindow


def test_nearest_rank_percentiles():
    w = LatencyWindow(100)
    assert all(math.isnan(v) for v in w.percentiles().values())
    for x in range(100, 0, -1):  # 100 .. 1, out of order
        w.add(x / 1000)
    assert w.percentiles() == {50: 0.05, 90: 0.09, 95: 0.095, 99: 0.099}
    w.add(1.0)  # the window keeps the last 100: 0.1 left, 1.0 came in
    assert w.count == 101 and w.percentiles()[99] == 0.099 and max(w._samples) == 1.0
    one = LatencyWindow(5)
    one.add(0.25)
    assert set(one.percentiles().values()) == {0.25}


@pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason)
def test_an_engine_records_each_requests_first_token_and_gaps(tiny_llama_q8):
    llm = LLM(tiny_llama_q8, threads=1)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 3, 5, 7)])
    summary = llm.engine.stats().latency
    assert summary.ttft_count == 4 and summary.itl_count == 0 + 2 + 4 + 6
    ttfts = sorted(o.metrics.prefill_seconds for o in outs)  # the same floats the engine recorded
    assert summary.ttft[50] == ttfts[1] and summary.ttft[99] == ttfts[3]
    assert list(summary.ttft) == list(summary.itl) == list(PERCENTILES)
    assert 0 < summary.itl[50] <= summary.itl[95] <= summary.itl[99]
