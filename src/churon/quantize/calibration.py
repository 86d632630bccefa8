"""Calibration: the statistics of every linear layer's inputs, gathered by running the model on text.

The model runs in float32 on the reference backend, one transformer block at a time over all the
calibration windows (calibrate_layerwise), wrapped so that each matmul also reports its input
rows x [tokens, cols]. Per weight (by GGUF tensor name) this keeps

    count     tokens seen
    sum_sq    sum of x^2 per input column: llama.cpp's importance matrix (tools/imatrix)
    sum_abs   sum of |x| per input column: AWQ's activation magnitude
    hessian   sum of x x^T [cols, cols] (optional): GPTQ's Hessian, and the exact calibration
              output error of any weight change D as tr(D H D^T) (AWQ's search objective)

q, k and v read the same input, as do gate and up: their names share one ActivationStats object.
Inputs are the same whichever row layout q/k are stored in (the llama permutation moves rows), so
these statistics apply to llama.cpp's layout as they are.

Text is cut into windows of ctx tokens as llama.cpp's imatrix tool does (consecutive chunks, BOS
written over the first token when the model asks for one), each run as one prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch
from tqdm import tqdm

from churon.evaluation import text_windows
from churon.engine.kv_cache import SequenceKVCache
from churon.formats.source import ModelSource
from churon.model.batch import ForwardBatch, SequenceChunk
from churon.model.reference_backend import ReferenceBackend
from churon.model.transformer import DecoderBlock, LayerWeights
from churon.quantize.source import SourceTensors
from churon.tokenizer import load_tokenizer

DEFAULT_CTX = 512


@dataclass
class ActivationStats:
    """Running statistics of one linear layer's input rows."""

    count: int
    sum_sq: torch.Tensor  # float64 [cols]
    sum_abs: torch.Tensor  # float64 [cols]
    hessian: torch.Tensor | None = None  # float64 [cols, cols], sum of x x^T

    @classmethod
    def empty(cls, cols: int, hessian: bool) -> "ActivationStats":
        z = torch.zeros(cols, dtype=torch.float64)
        return cls(0, z, z.clone(), torch.zeros(cols, cols, dtype=torch.float64) if hessian else None)

    def add(self, x: torch.Tensor) -> None:
        """Accumulate input rows x [tokens, cols]."""
        x = x.reshape(-1, x.shape[-1]).float()
        self.count += x.shape[0]
        self.sum_sq += x.square().sum(0, dtype=torch.float64)
        self.sum_abs += x.abs().sum(0, dtype=torch.float64)
        if self.hessian is not None:
            # one window's product in float32 (512 terms: ~1e-6 relative), the running sum in float64
            self.hessian += (x.T @ x).double()

    @property
    def mean_sq(self) -> torch.Tensor:
        return self.sum_sq / max(self.count, 1)

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.sum_abs / max(self.count, 1)


class _RecordingBackend(ReferenceBackend):
    """The float32 reference backend, feeding every matmul's input to the stats of its weight."""

    def __init__(self) -> None:
        super().__init__(torch.float32)
        self.stats_of: dict[int, ActivationStats] = {}  # id(weight tensor) -> its input stats

    def linear(self, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if id(w) in self.stats_of:
            self.stats_of[id(w)].add(x)
        return super().linear(w, x, bias)


def _attach_stats(layer: LayerWeights, index: int, backend: _RecordingBackend, hessian: bool) -> dict[str, ActivationStats]:
    """One ActivationStats per distinct matmul input of layer `index`, under the GGUF names of the weights reading it."""
    out: dict[str, ActivationStats] = {}
    inputs = ((layer.qkv, ("attn_q", "attn_k", "attn_v")), (layer.o, ("attn_output",)),
              (layer.gate_up, ("ffn_gate", "ffn_up")), (layer.down, ("ffn_down",)))
    for weight, names in inputs:
        stats = ActivationStats.empty(weight.shape[1], hessian)
        backend.stats_of[id(weight)] = stats
        out.update(dict.fromkeys([f"blk.{index}.{n}.weight" for n in names], stats))
    return out


def calibration_windows(
    source: ModelSource, text: str, ctx: int = DEFAULT_CTX, max_windows: int | None = None
) -> list[list[int]]:
    """The text's tokens in consecutive windows of ctx tokens (BOS first where the model adds one);
    ctx is capped at the model's context length."""
    ctx = min(ctx, source.config.context_length)
    tokenizer = load_tokenizer(source)
    tokens = tokenizer.encode(text, add_bos=False)
    windows = text_windows(tokens, ctx, max_windows, bos_id=tokenizer.bos_id if tokenizer.add_bos else None)
    if not windows:
        raise ValueError(f"the calibration text has {len(tokens)} tokens, fewer than one window of {ctx}")
    return windows


def calibrate_layerwise(
    tensors: SourceTensors, windows: Sequence[Sequence[int]], hessian: bool
) -> Iterator[dict[str, ActivationStats]]:
    """Input statistics of each transformer block's weights (by GGUF name), one block at a time in layer
    order, then those of the output matrix (token_embd.weight when the embeddings are tied).

    Only one block's weights and statistics are alive at once: the windows' residual streams are carried
    from block to block (float32, windows x tokens x hidden), each block read from the source when its
    turn comes and dropped after. The arithmetic is Transformer.forward_batch's, block by block.
    """
    if not windows:
        raise ValueError("no calibration windows")
    c, eps = tensors.config, tensors.config.rms_norm_eps
    backend = _RecordingBackend()
    freq_factors = tensors.read_canonical("rope_freqs.weight")[1] if "rope_freqs.weight" in tensors.shapes else None
    block = DecoderBlock(c, backend, freq_factors)
    cache = SequenceKVCache(replace(c, num_layers=1), max(len(w) for w in windows))  # each block in turn uses it
    batches = [ForwardBatch.build([SequenceChunk(list(w), 0, cache.block_table, need_logits=False)], cache.block_size)
               for w in windows]
    embeddings = tensors.read("token_embd.weight")
    scale = c.hidden_size**0.5 if c.scale_embeddings else 1.0  # Transformer.hidden_states' (Gemma)
    residuals = [embeddings[batch.input_ids] * scale for batch in batches]
    del embeddings

    def run_block(i: int) -> dict[str, ActivationStats]:  # its locals go when it returns
        layer = LayerWeights.build(c, i, dict(tensors.read_canonical(n) for n in tensors.block(i)), backend)
        stats = _attach_stats(layer, i, backend, hessian)
        for x, batch in zip(residuals, batches):
            h = backend.rms_norm(x, layer.input_norm, eps)
            down = block(layer, x, h, batch, cache, 0)  # Gemma: its norm after the MLP is the caller's
            x.add_(down if layer.mlp_out_norm is None else backend.rms_norm(down, layer.mlp_out_norm, eps))
        backend.stats_of.clear()
        return stats

    for i in range(c.num_layers):
        yield run_block(i)
    norm = tensors.read_canonical("output_norm.weight")[1]
    out = ActivationStats.empty(c.hidden_size, hessian)
    for x in residuals:
        out.add(backend.rms_norm(x, norm, eps))
    # with tied embeddings the logits read token_embd (llama.cpp's imatrix records it under that name)
    yield {"token_embd.weight" if c.tie_word_embeddings else "output.weight": out}


def collect_stats(
    model_source: ModelSource | SourceTensors,
    texts_or_windows: str | Sequence[Sequence[int]],
    hessian: bool,
    progress: bool = True,
    ctx: int = DEFAULT_CTX,
) -> dict[str, ActivationStats]:
    """Input statistics of every 2-D weight the model multiplies by, keyed by GGUF tensor name.

    model_source: the model, or its SourceTensors (a LoRA adapter merged in: quantize_model's).
    texts_or_windows: calibration text (cut into windows of ctx tokens), or token-id windows.
    hessian: also accumulate sum x x^T per input (GPTQ, AWQ); costs cols^2 float64 per distinct input,
    kept here for every layer (quantize_model keeps one layer's at a time, via calibrate_layerwise).
    """
    tensors = model_source if isinstance(model_source, SourceTensors) else SourceTensors(model_source)
    windows = (
        calibration_windows(tensors.source, texts_or_windows, ctx)
        if isinstance(texts_or_windows, str)
        else [list(w) for w in texts_or_windows]
    )
    stats: dict[str, ActivationStats] = {}
    layers = tqdm(total=tensors.config.num_layers + 1, desc="calibration", unit="layer", disable=not progress)
    for block_stats in calibrate_layerwise(tensors, windows, hessian):
        stats.update(block_stats)
        layers.update(1)
    layers.close()
    return stats
