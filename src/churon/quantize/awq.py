"""AWQ (Lin et al., 2023): scale input channels before quantizing, so that the channels carrying large
activations lose less to rounding, and fold the inverse scale into what produces those inputs.

For linears reading x, W diag(s) applied to x / s is the same map; the block quantizer sees the
columns of W multiplied by s, so channels with s > 1 get relatively finer steps. s = mean|x|^alpha
(normalized so its geometric middle is 1), alpha in [0, 1] searched per input group, minimizing the
calibration output error of the quantized weights,

    sum over the group's linears of tr(D H D^T),  D = W - Q(W diag(s)) diag(1/s),  H = sum x x^T,

which is exactly ||X W^T - X Wq^T||^2 over all calibration tokens (no sampled rows needed). alpha = 0
is s = 1, so the search never does worse than the unscaled quantizer on the calibration set.

Where the inverse scale goes, per transformer block (all exact rewrites of the float model):

    attn_q, attn_k, attn_v   columns * s,  attn_norm / s
    ffn_gate, ffn_up         columns * s,  ffn_norm / s
    ffn_down                 columns * s,  rows of ffn_up / s  (down reads silu(gate) * up)

attn_output is left alone: its input comes out of attention, where with grouped KV heads one v
row feeds several heads' columns, so a per-column scale cannot be folded into v in general.

The quantizer is the importance-weighted one (imatrix): after scaling, the inputs are x / s, so each
column's importance mean(x^2) becomes mean(x^2) / s^2.
"""

from __future__ import annotations

import numpy as np
import torch

from churon.formats.quants import dequantize, quant_type, quantize
from churon.quantize.calibration import ActivationStats
from churon.quantize.mixed import FLOAT_TYPES

ALPHAS = tuple(i / 10 for i in range(11))

# (linears sharing one input, tensor that absorbs 1 / s along that input: a norm vector, or weight rows)
_GROUPS = (
    (("attn_q", "attn_k", "attn_v"), "attn_norm"),
    (("ffn_gate", "ffn_up"), "ffn_norm"),
    (("ffn_down",), "ffn_up"),
)


def output_error(w: torch.Tensor, w_quant: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(D H D^T) with D = w - w_quant: the summed squared output change over the calibration inputs."""
    d = (w - w_quant).double()
    return float(((d @ hessian) * d).sum())


def _channel_scales(stats: ActivationStats, alpha: float) -> torch.Tensor:
    a = stats.mean_abs.clamp(min=1e-6 * float(stats.mean_abs.max().clamp(min=1e-30)))
    s = a.pow(alpha)
    return (s / (s.max() * s.min()).sqrt()).float()


def _scaled_importance(stats: ActivationStats, s: torch.Tensor | None) -> torch.Tensor:
    """Per-column importance of the inputs x / s of a weight whose columns were multiplied by s."""
    return (stats.mean_sq if s is None else stats.mean_sq / s.double().square()).float()


def search_scales(weights: list[torch.Tensor], qtypes: list[str], stats: ActivationStats) -> tuple[torch.Tensor, float]:
    """The per-input-channel scale (float32 [cols]) and its alpha minimizing the group's output error."""
    if stats.hessian is None:
        raise ValueError("AWQ's scale search needs the calibration Hessian (collect_stats(..., hessian=True))")
    best = None
    for alpha in ALPHAS:
        s = _channel_scales(stats, alpha)
        err = 0.0
        for w, qtype in zip(weights, qtypes):
            raw = quantize(w * s, qtype, importance=_scaled_importance(stats, s))
            w_eff = dequantize(raw, quant_type(qtype), tuple(w.shape)) / s
            err += output_error(w, w_eff, stats.hessian)
        if best is None or err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


class AWQMethod:
    name = "awq"
    needs_calibration = True
    needs_hessian = True

    def __init__(self) -> None:
        self.scales: dict[str, torch.Tensor] = {}  # GGUF weight name -> the s folded into it
        self.alphas: dict[str, float] = {}  # first linear of each group -> chosen alpha (for reports)

    def transform(
        self, layer: dict[str, torch.Tensor], stats: dict[str, ActivationStats], qtypes: dict[str, str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Search and fold the scales of one block. qtypes: GGUF name -> the type that tensor will be written in."""
        if qtypes is None:
            raise ValueError("AWQ searches its scales for the target types: transform needs qtypes")
        prefix = next(iter(layer)).rsplit(".", 2)[0] + "."  # "blk.N."
        out = dict(layer)
        for linears, absorber in _GROUPS:
            names = [prefix + n + ".weight" for n in linears]
            absorber_name = prefix + absorber + ".weight"
            group_stats = stats.get(names[0])
            if group_stats is None or any(n not in out or n not in qtypes for n in names) or absorber_name not in out:
                continue
            if any(quant_type(qtypes[n]) in FLOAT_TYPES for n in names):
                continue  # nothing is rounded coarsely: scaling cannot help
            s, alpha = search_scales([out[n] for n in names], [qtypes[n] for n in names], group_stats)
            for n in names:
                out[n] = out[n] * s
                self.scales[n] = s
            absorbed = out[absorber_name]
            out[absorber_name] = absorbed / s if absorbed.dim() == 1 else absorbed / s[:, None]
            self.alphas[names[0]] = alpha
        return out

    def quantize(self, name: str, w: torch.Tensor, qtype: str, stats: ActivationStats | None) -> np.ndarray:
        """w as transform left it (columns already times s, when the search scaled this tensor)."""
        if stats is None:
            return quantize(w, qtype)
        return quantize(w, qtype, importance=_scaled_importance(stats, self.scales.get(name)))
