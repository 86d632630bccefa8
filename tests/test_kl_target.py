"""The native fast path against churon's exact fp32 path on a long text, with llama.cpp's score as the bar.

llama.cpp's KL divergence from the same fp32 reference on the same windows was measured once
(benchmarks/record_llamacpp_kl.py, llama-cpp-python) and is stored in tests/data. Every token
goes through the same kernels in a prefill as in a decode step (batch invariance), so the
all-logits prefill used here scores the decode path too.
"""

import hashlib
import json
from pathlib import Path

import pytest

from churon import LLM, kernels
from churon.evaluation import compare, text_windows

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not kernels.native_available(), reason=kernels.reason)]

ROOT = Path(__file__).parent.parent
RECORD = ROOT / "tests" / "data" / "llamacpp_kl_gpl3.json"


def test_native_kl_and_top1_are_no_worse_than_llama_cpp(smollm2_gguf):
    record = json.loads(RECORD.read_text())
    text_path = ROOT / record["text"]  # the GNU GPL v3 as Debian ships it, copied into the repository
    assert hashlib.sha256(text_path.read_bytes()).hexdigest() == record["text_sha256"]
    reference = LLM(smollm2_gguf, kernels="reference", threads=2)
    native = LLM(smollm2_gguf, kernels="native", threads=2)
    windows = text_windows(reference.tokenizer.encode(text_path.read_text()), record["ctx"])
    assert len(windows) == record["n_windows"]
    result = compare(reference.model, native.model, windows)
    llama_cpp = record["metrics"]
    print(f"churon native: mean KL {result.mean_kl:.6f}, top-1 {result.top1_agreement:.4f};"
          f" llama.cpp: mean KL {llama_cpp['mean_kl']:.6f}, top-1 {llama_cpp['top1_agreement']:.4f}")
    assert result.n_tokens == llama_cpp["n_tokens"]
    assert result.mean_kl <= llama_cpp["mean_kl"]
    assert result.top1_agreement >= llama_cpp["top1_agreement"]
