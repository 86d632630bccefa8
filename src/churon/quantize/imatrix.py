"""Importance-matrix quantization (llama.cpp's imatrix): rounding error weighted by input energy.

For a linear layer y = x W^T, the output error of a weight change D over the calibration rows is
sum_t (x_t D^T)^2; keeping only the diagonal of the inputs' second moment, each weight's squared
error counts in proportion to mean(x_j^2) of its input column j. llama.cpp's imatrix tool collects
exactly that per column and llama-quantize hands it to quantize_row_*_impl as quant_weights, which
choose each block's scale (and min) minimizing the weighted squared error. Here the same values go
to formats.quants.quantize as `importance`; the block search itself lives there.
"""

from __future__ import annotations

import numpy as np
import torch

from churon.formats.quants import quantize
from churon.quantize.calibration import ActivationStats
from churon.quantize.rtn import RTNMethod


class ImatrixMethod(RTNMethod):
    name = "imatrix"
    needs_calibration = True
    needs_hessian = False

    def quantize(self, name: str, w: torch.Tensor, qtype: str, stats: ActivationStats | None) -> np.ndarray:
        return quantize(w, qtype, importance=None if stats is None else stats.mean_sq.float())
