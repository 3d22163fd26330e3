"""Linear layers with 8-bit block weights and 8-bit inputs (GGUF's Q8_0 x Q8_1), and embedding rows
read from the same copy.

A weight is held in blocks of 32 inputs per output: w = d * q with q int8 and one float16 d per
block (tpserve/kernels/block_weights.py), 1.0625 bytes a weight as in a Q8_0 GGUF. It serves a tied
embedding and head from one copy: `__call__` is the head's product, `rows(ids)` the embedding's
lookup, each row d * q exactly as `dequantize()` has it. As for the 4-bit weights
(tpserve/kernels/q4_linear.py, whose input quantization this kernel shares), every input row is quantized
per block of 32 on its own, each block's product is an exact int32 and the float epilogue per block
is fixed elementwise in tpserve/kernels/native/q8_linear.c: a row has the same bits at any batch and on the
AVX-512 VNNI, AVX2 and scalar paths. The C kernel runs on one thread, whatever torch's count.

Why 8 bits: SmolLM2's GGUF keeps its tied embedding and head in Q8_0, and requantizing them to 4
bits costs about 4% perplexity. bench/q8_linear.py sets this kernel against int8 (FBGEMM) and 4 bits.
"""

from __future__ import annotations

import torch

from tpserve.kernels.block_weights import BLOCK, GROUP, BlockKernel, check_block_shape, exact_half, half_up
from tpserve.kernels.int8_linear import PackedWeight, QuantizeError

VALUES_BYTES = 512  # per (group, block): 16 outputs x 32 int8 values, then d[16] in float16
GROUP_BLOCK_BYTES = VALUES_BYTES + 2 * GROUP
INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
KERNEL = BlockKernel(
    "q8_linear", paths="tp_q8_paths", linear="tp_q8_linear", what="8-bit block kernel", lookup="tp_q8_rows"
)


def q8_available() -> str | None:
    """None where the 8-bit block kernel builds and runs here; else why not, in words."""
    return KERNEL.unavailable()


def supported_paths() -> list[str]:
    """The kernel's code paths this CPU runs, "scalar" always among them."""
    return KERNEL.supported_paths()


class Q8Weight(PackedWeight):
    """One [out, in] weight in 8-bit blocks; `__call__(x [T, in]) -> [T, out]` float32, and
    `rows(ids)` its dequantized rows (a tied embedding's lookup)."""

    def __init__(self, weight: torch.Tensor):
        """Quantize a float weight symmetrically per block of 32, as Q8_0 does: d = absmax / 127 in
        float16 rounded up (so no value passes 127 d), q = round(w / d) against that very d."""
        check_block_shape(weight, "8-bit")
        weight = weight.detach().float()
        blocks = weight.view(weight.shape[0], -1, BLOCK)
        d = half_up(blocks.abs().amax(dim=-1) / 127, "8-bit")
        steps = blocks / d.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        q = steps.round_().clamp_(-127, 127).to(torch.int8).view(weight.shape)
        self._pack(q, d)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Q8Weight:
        return cls(weight)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor) -> Q8Weight:
        """A checkpoint's own Q8_0 blocks, packed as stored: q [out, in] integers in -128..127 (int8,
        or a wider integer type), d [out, in / 32] (float16, or float32 or bfloat16 values that
        float16 holds exactly: others are refused by name), weight = d * q. Nothing is rounded again."""
        if q.dtype not in INTEGER_DTYPES or q.dim() != 2:
            raise QuantizeError(
                f"8-bit values must be signed integers (int8) [out, in], got {q.dtype} {list(q.shape)}"
            )
        check_block_shape(q, "8-bit")
        d = exact_half(d, "d", (q.shape[0], q.shape[1] // BLOCK), q.shape)
        if q.numel() and (int(q.min()) < -128 or int(q.max()) > 127):
            raise QuantizeError(f"8-bit values must lie in -128..127, got {int(q.min())}..{int(q.max())}")
        weight = cls.__new__(cls)
        weight._pack(q.to(torch.int8), d)
        return weight

    def _pack(self, q: torch.Tensor, d: torch.Tensor) -> None:
        # q: [N, K] int8; d: [N, K/32] float16 -> [groups, blocks, 544] uint8 (q8_linear.c).
        # The C kernel is all this weight needs (no FBGEMM).
        self.shape, self.device = (q.shape[0], q.shape[1]), q.device
        q, d = KERNEL.grouped(q, d)
        num_groups, num_blocks = q.shape[0] // GROUP, q.shape[1] // BLOCK
        # Within a block, input k = 4 chunk + j; byte (chunk, output, j).
        values = q.view(num_groups, GROUP, num_blocks, 8, 4).permute(0, 2, 3, 1, 4)
        values = values.reshape(num_groups, num_blocks, VALUES_BYTES).view(torch.uint8)
        scales = d.view(num_groups, GROUP, num_blocks).transpose(1, 2).contiguous()
        scale_bytes = scales.view(torch.uint8).view(num_groups, num_blocks, 2 * GROUP)
        self._packed = torch.cat((values, scale_bytes), dim=-1).contiguous()
        self.nbytes = self._packed.numel()

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored blocks: q [out, in] int8, d [out, in / 32] float16; from_blocks of them packs
        the same weight again."""
        num_groups, num_blocks, _ = self._packed.shape
        values = self._packed[..., :VALUES_BYTES].contiguous().view(torch.int8)
        q = values.view(num_groups, num_blocks, 8, GROUP, 4).permute(0, 3, 1, 2, 4)
        q = q.reshape(num_groups * GROUP, num_blocks * BLOCK)
        scales = self._packed[..., VALUES_BYTES:].contiguous().view(torch.float16)
        d = scales.view(num_groups, num_blocks, GROUP).transpose(1, 2).reshape(num_groups * GROUP, num_blocks)
        return q[: self.shape[0]], d[: self.shape[0]]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the products compute with, d * q (for tests and references)."""
        q, d = self.blocks()
        return (q.view(q.shape[0], -1, BLOCK).float() * d.float()[..., None]).view(q.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [n] int64 output indices -> [n, in] float32, the rows d * q of dequantize() (bit for
        bit), read from the packed weight itself: a tied embedding's lookup."""
        return KERNEL.rows(self._packed, self.shape, ids)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
        # x: [T, in] -> [T, out] float32. path: one of PATHS, to check every path gives the same bits.
        return KERNEL.run(self._packed, self.shape, x, bias, path)
