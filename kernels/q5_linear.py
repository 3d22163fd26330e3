"""Linear layers with 5-bit weights (GGUF's Q5_0, Q5_1 and Q5_K) and 8-bit inputs.

A weight is held in blocks of 32 inputs per output, w = d * q + m with q in 0..31: the 4-bit
weights' arithmetic (kernels/q4_linear.py, kernels/native/q4_blocks.h) on values a byte each, laid
out as the 8-bit weights' (kernels/q8_linear.py). Q5_0 is m = -16 d; Q5_K's blocks are d = d * sc
and m = -dmin * mn, exact in float32 only, kept in a float32 layout as Q4_K's are. So a GGUF's Q5
tensor is served with its own values: 1.125 bytes a weight with float16 scales (the GGUF's Q5_1:
0.75), 1.25 with float32 (Q5_K: 0.69). A row has the same bits at any batch and on every path.
"""

from __future__ import annotations

import torch

from tpserve.kernels.block_weights import BlockKernel, byte_chunks, from_byte_chunks
from tpserve.kernels.q4_linear import Q4Weight

VALUE_BYTES = 512  # per (group, block): 16 outputs x 32 values 0..31, then d[16] and m[16]
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
    VALUE_BYTES = VALUE_BYTES
    KERNELS = {torch.float16: KERNEL, torch.float32: KERNEL_F32}  # by the scales' dtype

    @staticmethod
    def _values_layout(q: torch.Tensor) -> torch.Tensor:
        return byte_chunks(q)

    @staticmethod
    def _values(layout: torch.Tensor) -> torch.Tensor:
        return from_byte_chunks(layout)
