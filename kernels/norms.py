"""RMS norm, computed in float32 and returned in the input's dtype (as the reference models do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, D], weight: [D]. One fused call in float32; otherwise the reference's order: normalise
    # in float32, round to the input's dtype, then scale.
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
