"""Linear layers with 5-bit weights (GGUF's Q5_0, Q5_1 and Q5_K) and 8-bit inputs.

A weight is held in blocks of 32 inputs per output, w = d * q + m with q in 0..31: the 4-bit
weights' layout and arithmetic (tpserve/kernels/q4_linear.py, tpserve/kernels/native/q4_blocks.h) with each
value's fifth bit beside its nibble. Q5_0 is m = -16 d; Q5_K's blocks are d = d * sc and m = -dmin
* mn, exact in float32 only, kept in a float32 layout as Q4_K's are. So a GGUF's Q5 tensor is
served with its own values: 0.75 bytes a weight with float16 scales (as the GGUF's Q5_1), 0.875
with float32 (Q5_K: 0.69). A row has the same bits at any batch and on every path.
"""

from __future__ import annotations

import torch

from tpserve.kernels.block_weights import BLOCK, GROUP, BlockKernel
from tpserve.kernels.q4_linear import Q4Weight

NIBBLE_BYTES, TOP_BYTES = 256, 64  # per (group, block): the 4-bit layout's nibbles, their fifth bits
KERNEL = BlockKernel("q5_linear", paths="tp_q5_paths", linear="tp_q5_linear", what="5-bit kernel")
KERNEL_F32 = BlockKernel(
    "q5f_linear", paths="tp_q5f_paths", linear="tp_q5f_linear", what="5-bit kernel with float32 scales"
)


def q5_available() -> str | None:
    """None where both builds of the 5-bit kernel run here; else why not, in words."""
    return KERNEL.unavailable() or KERNEL_F32.unavailable()


class Q5Weight(Q4Weight):
    """One [out, in] weight in 5-bit blocks; `__call__(x [T, in]) -> [T, out]` float32."""

    BITS = "5-bit"
    VALUE_MAX = 31
    VALUE_BYTES = NIBBLE_BYTES + TOP_BYTES
    KERNELS = {torch.float16: KERNEL, torch.float32: KERNEL_F32}  # by the scales' dtype

    @staticmethod
    def _values_layout(q: torch.Tensor) -> torch.Tensor:
        """q [N, K] (whole groups) -> [groups, blocks, 320]: the nibbles, then the fifth bits, byte
        (output, j)'s bit i that of input 4i + j."""
        num_groups, num_blocks = q.shape[0] // GROUP, q.shape[1] // BLOCK
        top = (q >> 4).view(num_groups, GROUP, num_blocks, 8, 4).permute(0, 2, 1, 4, 3)
        top = (top << torch.arange(8, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)
        nibbles = Q4Weight._values_layout(q & 15)
        return torch.cat((nibbles, top.reshape(num_groups, num_blocks, TOP_BYTES)), dim=-1)

    @staticmethod
    def _values(layout: torch.Tensor) -> torch.Tensor:
        num_groups, num_blocks, _ = layout.shape
        top = layout[..., NIBBLE_BYTES:].reshape(num_groups, num_blocks, GROUP, 4, 1)
        top = (top >> torch.arange(8, dtype=torch.uint8)) & 1  # [g, b, output, j, i]
        top = top.permute(0, 2, 1, 4, 3).reshape(num_groups * GROUP, num_blocks * BLOCK)
        return Q4Weight._values(layout[..., :NIBBLE_BYTES]) | (top << 4)
