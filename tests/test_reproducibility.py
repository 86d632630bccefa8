"""Outputs are reproducible bit for bit across fresh processes (issue 13: one server run in eight differed).

benchmarks/reproducibility.py is the campaign: a 64-request greedy burst (half of it behind a shared
system prompt, so that prefix-cache hits and batch composition vary) and 8 probes one at a time, run
in fresh `LLM` and `churon serve` processes with other thread counts and PYTHONHASHSEEDs, every
request fingerprinted by its text and the exact logprob of every generated token. These slow tests
run a small version of it and check it against the same workload run in this process.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "reproducibility.py"
MAX_TOKENS = 16
# 7 blocks of 16 tokens of SmolLM2's float32 K and V (30 layers x 3 kv heads x 64 x 4 bytes, twice): the
# burst's prompts take up to 4 blocks each, so sequences are preempted and cached prefixes evicted
SMALL_KV_BYTES = 7 * 16 * (2 * 30 * 3 * 64 * 4)


def campaign(tmp_path: Path, model: Path, *flags: str) -> dict:
    out = tmp_path / "campaign.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--max-tokens", str(MAX_TOKENS),
                        "--json", str(out), *flags], capture_output=True, text=True, timeout=1800, check=False)
    assert p.returncode in (0, 1), p.stdout[-3000:] + p.stderr[-3000:]  # 1: runs differ (checked below)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """The workload's fingerprints from an LLM in this process."""
    spec = importlib.util.spec_from_file_location("reproducibility", SCRIPT)
    repro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repro)
    result = repro.child_llm(str(smollm2_gguf), 2, MAX_TOKENS, {})
    return [repro.fingerprint(text, logprobs) for text, logprobs in result["outputs"]]


@pytest.mark.slow
def test_fresh_llm_and_server_processes_agree_bit_for_bit(tmp_path, smollm2_gguf, reference):
    """Two LLM and two server processes, 1 and 2 threads, random hash seeds: every request's text and
    logprobs equal those of this process."""
    data = campaign(tmp_path, smollm2_gguf, "--runs", "2", "--mode", "both", "--threads", "1,2")
    assert not data["failed"], data["failed"]
    runs = data["runs"]
    assert sorted((r["mode"], r["threads"]) for r in runs) == [("llm", 1), ("llm", 2), ("server", 1), ("server", 2)]
    assert len({r["hashseed"] for r in runs}) == 4
    for r in runs:
        differing = [i for i, (a, b) in enumerate(zip(r["fingerprints"], reference)) if a != b]
        assert len(r["fingerprints"]) == len(reference) == 72 and not differing, (r["mode"], r["threads"], differing)


@pytest.mark.slow
def test_poisoned_memory_and_preemption_change_nothing(tmp_path, smollm2_gguf, reference):
    """Memory nobody wrote poisoned (torch.empty NaN, malloc 0x5a bytes) and a KV pool of 7 blocks
    (preemptions, recomputation, evicted prefixes): the same bits as this process's unpoisoned run with
    a pool that never fills, so no kernel reads memory before writing it and a recomputed or cached
    prefix gives the same K/V."""
    data = campaign(tmp_path, smollm2_gguf, "--runs", "1", "--mode", "llm", "--threads", "2", "--poison",
                    "--kv-cache-memory", str(SMALL_KV_BYTES))
    [run] = data["runs"]
    assert run["num_blocks"] == 7 and run["preemptions"] > 0 and run["evictions"] > 0, run
    differing = [i for i, (a, b) in enumerate(zip(run["fingerprints"], reference)) if a != b]
    assert not differing, differing
