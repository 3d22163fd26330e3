"""RMSNorm with its weight owned: Llama's, and Gemma's that scales by (1 + w)."""

from __future__ import annotations

import torch

from tpserve.kernels.norms import rms_norm


class RMSNorm:
    """x / rms(x) * weight over the last dim (tpserve/kernels/norms.py rms_norm).

    plus_one: Gemma's weights are stored around zero and scale by (1 + w); the factor is computed
    once, in float32 as the reference's forward computes it, and kept so (rms_norm then scales
    before rounding to a narrower dtype, as Gemma's does)."""

    def __init__(self, weight: torch.Tensor, eps: float, *, plus_one: bool = False):
        self.weight = 1.0 + weight.float() if plus_one else weight  # [D]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
