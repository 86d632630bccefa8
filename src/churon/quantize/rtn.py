"""Round-to-nearest: each block's scale (and min) from its own values only, as llama-quantize does
without an importance matrix (formats.quants.quantize with importance=None). The baseline method."""

from __future__ import annotations

import numpy as np
import torch

from churon.formats.quants import quantize
from churon.quantize.calibration import ActivationStats


class RTNMethod:
    """Also the base of the methods that change no tensor before quantizing (imatrix, GPTQ)."""

    name = "rtn"
    needs_calibration = False
    needs_hessian = False

    def transform(
        self, layer: dict[str, torch.Tensor], stats: dict[str, ActivationStats], qtypes: dict[str, str] | None = None
    ) -> dict[str, torch.Tensor]:
        return layer

    def quantize(self, name: str, w: torch.Tensor, qtype: str, stats: ActivationStats | None) -> np.ndarray:
        return quantize(w, qtype)
