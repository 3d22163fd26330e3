"""A product whose outputs are stacked from parts packed each in its own format.

A Q4_K_M GGUF keeps q and k in Q4_K but v in Q6_K (in some layers), so the fused q/k/v product has
parts of different widths in bits. Each part is served as the file stores it and the outputs are
concatenated: one call per part, no value rounded twice. Every part is a packed weight whose row
has the same bits at any batch (tpserve/kernels/block_weights.py), so the stack's rows do too.
"""

from __future__ import annotations

import torch

from tpserve.kernels.int8_linear import PackedWeight


class StackedWeight(PackedWeight):
    """[sum of parts' out, in]: `__call__(x [T, in]) -> [T, out]` float32, parts' outputs in order."""

    def __init__(self, parts: list[PackedWeight]):
        widths = {part.shape[1] for part in parts}
        if len(widths) != 1:
            raise ValueError(f"stacked parts need one input width, got {sorted(widths)}")
        self.parts = parts
        self.shape = (sum(part.shape[0] for part in parts), widths.pop())
        self.device = parts[0].device
        self.nbytes = sum(part.nbytes for part in parts)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the products compute with (for tests and references)."""
        return torch.cat([part.dequantize() for part in self.parts])

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]: one product per part, concatenated along the outputs.
        out = torch.cat([part(x) for part in self.parts], dim=1)
        return out.add_(bias) if bias is not None else out
