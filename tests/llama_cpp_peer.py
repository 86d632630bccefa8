"""llama.cpp (llama-cpp-python) as the peer that loads the GGUF files churon writes: models, merged exports
and adapters. Test-support code, imported by tests; each caller skips without llama_cpp installed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch


def llama_cpp_model(path: Path, lora: Path | None = None):
    """llama.cpp on 2 threads with every position's logits kept; lora: a GGUF adapter applied unmerged."""
    llama_cpp = pytest.importorskip("llama_cpp")
    kwargs = {"lora_path": str(lora)} if lora is not None else {}
    return llama_cpp.Llama(str(path), n_threads=2, n_ctx=128, logits_all=True, verbose=False, **kwargs)


def llama_cpp_logits(path: Path, tokens: list[int], lora: Path | None = None) -> torch.Tensor:
    m = llama_cpp_model(path, lora)
    m.eval(tokens)
    return torch.tensor(np.array(m.scores[: len(tokens)]))


def llama_cpp_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    m = llama_cpp_model(path)
    m.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(m.scores[m.n_tokens - 1])))
        m.eval(out[-1:])
    return out
