"""Pooling: one vector per input from its tokens' final hidden states (sentence-transformers' Pooling and
Normalize modules; llama.cpp's pooling types).

    mean  the average over the input's tokens (special tokens included, as sentence-transformers does)
    cls   the first token's state (BERT's [CLS])
    last  the last token's state (decoder embedders: the only token that has seen the whole input)

Each input is reduced on its own rows only, so its vector does not depend on what else is in the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from churon.config import PoolingConfig

# sentence-transformers' Normalize is F.normalize's default: a zero vector stays zero
NORMALIZE_EPS = 1e-12


def pool(hidden: torch.Tensor, seq_starts: list[int], pooling: PoolingConfig) -> torch.Tensor:
    """hidden: [tokens, hidden] of inputs packed back to back (input i is rows seq_starts[i]:seq_starts[i + 1]).
    Returns float32 [inputs, hidden]."""
    hidden = hidden.float()
    rows = []
    for a, b in zip(seq_starts[:-1], seq_starts[1:]):
        if pooling.mode == "mean":
            rows.append(hidden[a:b].sum(0) / (b - a))
        elif pooling.mode == "cls":
            rows.append(hidden[a])
        else:
            rows.append(hidden[b - 1])
    out = torch.stack(rows)
    return F.normalize(out, p=2.0, dim=-1, eps=NORMALIZE_EPS) if pooling.normalize else out
