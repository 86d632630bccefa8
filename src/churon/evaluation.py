"""Quality metrics over a long text: perplexity, and KL divergence / top-1 agreement between two models.

The procedure follows llama.cpp's `llama-perplexity` (tools/perplexity/perplexity.cpp), so numbers
are comparable with what it prints:

- the text's tokens are cut into consecutive, non-overlapping windows of `ctx` tokens (the short tail
  is dropped); each window runs as one prefill from an empty KV cache (BOS written over the window's
  first token when the model asks for one);
- only the second half of each window is scored: the logits at positions ctx//2 .. ctx-2, each
  predicting the token after it, so every scored token has at least ctx/2 tokens of context
  (255 scored tokens per 512-token window);
- per scored position: the negative log-likelihood of the next token under each model,
  KL(P_ref || P_test) = sum_v p_ref(v) * (log p_ref(v) - log p_test(v)), and whether both models put
  their largest logit on the same token ("Same top p");
- perplexity = exp(mean NLL); percentiles interpolate linearly between sorted values (p * (n - 1)).

One difference: llama.cpp stores the reference log-probabilities in 16 bits and skips vocabulary
entries with p_ref < e^-16; here both sides come straight from float32 logits and the KL sum runs
over the whole vocabulary in float64.

Memory: one window's logits are ctx x vocab float32 (512 x 49152 = 100 MB); windows are processed one
at a time and only per-token statistics are kept.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from churon.engine.kv_cache import SequenceKVCache
from churon.model.transformer import Transformer

LogitsFn = Callable[[Sequence[int]], torch.Tensor]  # window -> float32 logits [len(window), vocab]

_CHUNK_ROWS = 64  # rows per float64 log_softmax: 64 x 49152 x 8 bytes = 25 MB per temporary


def text_windows(
    tokens: Sequence[int], ctx: int = 512, max_windows: int | None = None, bos_id: int | None = None
) -> list[list[int]]:
    """Consecutive non-overlapping windows of ctx tokens; the short tail is dropped.

    bos_id: when given, each window's first token is replaced by it (llama.cpp does so for models
    whose tokenizer adds a BOS).
    """
    if ctx < 2:
        raise ValueError(f"ctx={ctx}: a window needs at least 2 tokens")
    n = len(tokens) // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    windows = [[int(t) for t in tokens[i * ctx : (i + 1) * ctx]] for i in range(n)]
    if bos_id is not None:
        for w in windows:
            w[0] = bos_id
    return windows


def scored_positions(ctx: int) -> slice:
    """The window positions whose logits are scored: ctx//2 .. ctx-2 (each predicts the next token)."""
    return slice(ctx // 2, ctx - 1)


def window_logits(model: Transformer, window: Sequence[int]) -> torch.Tensor:
    """float32 logits [len(window), vocab] from one prefill over a fresh KV cache."""
    cache = SequenceKVCache.for_model(model, len(window))
    return model(torch.tensor(list(window), dtype=torch.long), 0, cache, all_logits=True)


def _logits_fn(source: "Transformer | LogitsFn") -> LogitsFn:
    if isinstance(source, Transformer):
        return lambda window: window_logits(source, window)
    return source  # type: ignore[return-value]


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[target] per row, float64 [n]. logits [n, vocab], targets [n]."""
    targets = torch.as_tensor(targets, dtype=torch.long)
    out = torch.empty(logits.shape[0], dtype=torch.float64)
    for i in range(0, logits.shape[0], _CHUNK_ROWS):
        logp = F.log_softmax(logits[i : i + _CHUNK_ROWS].double(), dim=-1)
        out[i : i + _CHUNK_ROWS] = -logp.gather(-1, targets[i : i + _CHUNK_ROWS, None])[:, 0]
    return out


def perplexity_from_nll(nll: torch.Tensor | Sequence[float]) -> float:
    """exp(mean negative log-likelihood)."""
    nll = torch.as_tensor(nll, dtype=torch.float64)
    if nll.numel() == 0:
        raise ValueError("no tokens to score")
    return math.exp(nll.mean().item())


@dataclass
class TokenStats:
    """Per scored position: KL(P_ref || P_test), same-argmax flag, and (with targets) each model's NLL."""

    kl: torch.Tensor  # float64 [n]
    top1_match: torch.Tensor  # bool [n]
    nll_ref: torch.Tensor | None = None  # float64 [n]
    nll_test: torch.Tensor | None = None  # float64 [n]


def compare_logits(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor | None = None) -> TokenStats:
    """Row-by-row comparison of two [n, vocab] logit tensors (ref is the distribution P of KL(P || Q)).

    targets ([n] token ids, the token each row predicts) adds both models' NLLs.
    """
    if ref.shape != test.shape or ref.dim() != 2:
        raise ValueError(
            f"logits must both be [n, vocab] with equal shapes, got {tuple(ref.shape)} and {tuple(test.shape)}"
        )
    n = ref.shape[0]
    kl = torch.empty(n, dtype=torch.float64)
    nll_ref = nll_test = None
    if targets is not None:
        targets = torch.as_tensor(targets, dtype=torch.long).reshape(-1)
        if targets.shape[0] != n:
            raise ValueError(f"{targets.shape[0]} targets for {n} rows of logits")
        nll_ref, nll_test = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
    for i in range(0, n, _CHUNK_ROWS):
        rows = slice(i, i + _CHUNK_ROWS)
        logp = F.log_softmax(ref[rows].double(), dim=-1)
        logq = F.log_softmax(test[rows].double(), dim=-1)
        kl[rows] = (logp.exp() * (logp - logq)).sum(-1)
        if targets is not None:
            t = targets[rows, None]
            nll_ref[rows] = -logp.gather(-1, t)[:, 0]
            nll_test[rows] = -logq.gather(-1, t)[:, 0]
    top1 = ref.argmax(-1) == test.argmax(-1)  # first index of the maximum on both sides, as llama.cpp
    return TokenStats(kl, top1, nll_ref, nll_test)


@dataclass
class Comparison:
    mean_kl: float
    median_kl: float
    p99_kl: float
    max_kl: float
    top1_agreement: float  # fraction of scored positions with the same argmax
    n_tokens: int  # scored positions
    ppl_test: float | None
    ppl_ref: float | None

    def as_dict(self) -> dict:
        return asdict(self)


class ComparisonAccumulator:
    """Collects TokenStats window by window (a few numbers per token) and summarizes them."""

    def __init__(self) -> None:
        self._stats: list[TokenStats] = []

    def add(self, stats: TokenStats) -> None:
        self._stats.append(stats)

    def add_window(self, ref_logits: torch.Tensor, test_logits: torch.Tensor, window: Sequence[int]) -> TokenStats:
        """Scores the second half of one window (llama.cpp's positions) and keeps the per-token stats."""
        stats = compare_window(ref_logits, test_logits, window)
        self.add(stats)
        return stats

    def result(self) -> Comparison:
        if not self._stats:
            raise ValueError("no windows were compared")
        kl = torch.cat([s.kl for s in self._stats])
        top1 = torch.cat([s.top1_match for s in self._stats])
        with_nll = all(s.nll_ref is not None for s in self._stats)
        return Comparison(
            mean_kl=kl.mean().item(),
            median_kl=torch.quantile(kl, 0.5).item(),
            p99_kl=torch.quantile(kl, 0.99).item(),
            max_kl=kl.max().item(),
            top1_agreement=top1.double().mean().item(),
            n_tokens=kl.numel(),
            ppl_test=perplexity_from_nll(torch.cat([s.nll_test for s in self._stats])) if with_nll else None,
            ppl_ref=perplexity_from_nll(torch.cat([s.nll_ref for s in self._stats])) if with_nll else None,
        )


def compare_window(ref_logits: torch.Tensor, test_logits: torch.Tensor, window: Sequence[int]) -> TokenStats:
    """TokenStats over the scored half of one window, given both models' logits for all its positions."""
    ctx = len(window)
    if ref_logits.shape[0] != ctx or test_logits.shape[0] != ctx:
        raise ValueError(
            f"logits for {ref_logits.shape[0]} and {test_logits.shape[0]} positions, the window has {ctx} tokens"
        )
    pos = scored_positions(ctx)
    targets = torch.tensor(list(window[pos.start + 1 : pos.stop + 1]), dtype=torch.long)
    return compare_logits(ref_logits[pos], test_logits[pos], targets)


def compare(
    ref: "Transformer | LogitsFn", test: "Transformer | LogitsFn", windows: Iterable[Sequence[int]]
) -> Comparison:
    """KL(ref || test), top-1 agreement and both perplexities over windows (from `text_windows`).

    ref / test: a Transformer, or a function window -> float32 logits [len(window), vocab].
    """
    ref_fn, test_fn = _logits_fn(ref), _logits_fn(test)
    acc = ComparisonAccumulator()
    for window in windows:
        acc.add_window(ref_fn(window), test_fn(window), window)
    return acc.result()


def perplexity(model: "Transformer | LogitsFn", windows: Iterable[Sequence[int]]) -> float:
    """llama.cpp-style perplexity: exp(mean NLL) over the second half of every window."""
    fn = _logits_fn(model)
    nll = []
    for window in windows:
        pos = scored_positions(len(window))
        targets = torch.tensor(list(window[pos.start + 1 : pos.stop + 1]), dtype=torch.long)
        nll.append(token_nll(fn(window)[pos], targets))
    if not nll:
        raise ValueError("no windows to score: the text is shorter than one window")
    return perplexity_from_nll(torch.cat(nll))
