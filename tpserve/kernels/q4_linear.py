"""Linear layers with 4-bit weights and 8-bit inputs (GGUF's Q4_1 x Q8_1), a row independent of the rest.

A weight is held in blocks of 32 inputs per output: w = d * q + m with q in 0..15 and float16 d and
m per block (tpserve/kernels/block_weights.py), 0.625 bytes a weight as in a Q4_1 GGUF (0.5 for the nibbles,
0.125 for the scales). A checkpoint's blocks whose scales float16 does not hold (GGUF's Q4_K: d * sc
and -dmin * mn, exact in float32) keep them in float32 instead, 0.75 bytes a weight, in a second
build of the same kernel (tpserve/kernels/native/q4f_linear.c) whose arithmetic is the very same. Every input
row is quantized per block of 32 on its own (absmax / 127 to int8), each block's product is an exact int32,
and the float epilogue per block is fixed elementwise in tpserve/kernels/native/q4_linear.c. So a row has the
same bits alone, in a decode round or inside a long prompt, and the AVX-512 VNNI, AVX2 and scalar paths agree
bit for bit: which CPU runs a rank changes its speed, never its numbers. The C kernel runs on one thread,
whatever torch's count.

Why our own kernel: torch's `_weight_int4pack_mm_for_cpu` is row-invariant but 3x slower than
FBGEMM's int8 at 16 rows here and 2x slower at one row on AVX2 machines (issue 13's measurements).
bench/q4_linear.py sets this kernel against int8 and float32.
"""

from __future__ import annotations

import torch

from tpserve.kernels.block_weights import (
    BLOCK,
    GROUP,
    BlockKernel,
    block_scales,
    check_block_shape,
    half_down,
    half_up,
    holds_in_half,
)
from tpserve.kernels.int8_linear import PackedWeight, QuantizeError

NIBBLE_BYTES = 256  # per (group, block): 16 outputs x 32 nibbles, then d[16] and m[16]
GROUP_BLOCK_BYTES = NIBBLE_BYTES + 2 * GROUP * 2  # 320: float16 scales
GROUP_BLOCK_BYTES_F32 = NIBBLE_BYTES + 2 * GROUP * 4  # 384: float32 scales
KERNEL = BlockKernel("q4_linear", paths="tp_q4_paths", linear="tp_q4_linear", what="4-bit kernel")
KERNEL_F32 = BlockKernel(
    "q4f_linear", paths="tp_q4f_paths", linear="tp_q4f_linear", what="4-bit kernel with float32 scales"
)
KERNELS = {torch.float16: KERNEL, torch.float32: KERNEL_F32}  # by the scales' dtype


def q4_available() -> str | None:
    """None where both builds of the 4-bit kernel (float16 and float32 scales) run here; else why
    not, in words."""
    return KERNEL.unavailable() or KERNEL_F32.unavailable()


def supported_paths() -> list[str]:
    """The kernel's code paths this CPU runs, "scalar" always among them."""
    return KERNEL.supported_paths()


class Q4Weight(PackedWeight):
    """One [out, in] weight in 4-bit blocks; `__call__(x [T, in]) -> [T, out]` float32.

    The 5-bit weights (tpserve/kernels/q5_linear.py) are this class with its values a byte each: what
    differs is said by the class attributes and the two value layouts' methods."""

    BITS = "4-bit"  # how messages name it
    VALUE_MAX = 15
    VALUE_BYTES = NIBBLE_BYTES  # per (group, block)
    KERNELS = KERNELS

    def __init__(self, weight: torch.Tensor):
        """Quantize a float weight asymmetrically per block of 32, as Q4_1 does, the scales in float16
        rounded outwards: m = min rounded down, d = (max - m) / 15 rounded up, so m + 15 d still
        reaches max; then q = round((w - m) / d) in 0..15 against those very d and m (0..31 and 31
        for 5 bits)."""
        check_block_shape(weight, self.BITS)
        weight = weight.detach().float()
        blocks = weight.view(weight.shape[0], -1, BLOCK)
        m = half_down(blocks.amin(dim=-1), self.BITS)
        d = half_up((blocks.amax(dim=-1) - m.float()) / self.VALUE_MAX, self.BITS)
        step = d.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        q = ((blocks - m.float()[..., None]) / step).round_().clamp_(0, self.VALUE_MAX)
        self._pack(q.to(torch.uint8).view(weight.shape), d, m)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Q4Weight:
        return cls(weight)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4Weight:
        """A checkpoint's own blocks, packed as stored: q [out, in] uint8 in 0..15, d and m [out, in / 32]
        float16, float32 or bfloat16, weight = d * q + m. Nothing is rounded again: scales float16
        holds exactly are packed in float16, others (GGUF's Q4_K) in the float32 layout, whose
        products are the same arithmetic on the same values. GGUF's Q4_0 is m = -8 d."""
        if q.dtype != torch.uint8 or q.dim() != 2:
            raise QuantizeError(f"{cls.BITS} values must be uint8 [out, in], got {q.dtype} {list(q.shape)}")
        check_block_shape(q, cls.BITS)
        blocks = (q.shape[0], q.shape[1] // BLOCK)
        d, m = block_scales(d, "d", blocks, q.shape), block_scales(m, "m", blocks, q.shape)
        if holds_in_half(d) and holds_in_half(m):
            d, m = d.to(torch.float16), m.to(torch.float16)
        if q.numel() and int(q.max()) > cls.VALUE_MAX:
            raise QuantizeError(
                f"{cls.BITS} values must lie in 0..{cls.VALUE_MAX}, got one of {int(q.max())}"
            )
        weight = cls.__new__(cls)
        weight._pack(q, d, m)
        return weight

    def _pack(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        # q: [N, K] uint8 0..15; d, m: [N, K/32] both float16 or both float32 -> [groups, blocks, 320
        # or 384] uint8 (tpserve/kernels/native/q4_blocks.h), run by that layout's build of the kernel.
        self.shape, self.device = (q.shape[0], q.shape[1]), q.device
        self._kernel = self.KERNELS[d.dtype]
        q, d, m = self._kernel.grouped(q, d, m)
        num_groups, num_blocks = q.shape[0] // GROUP, q.shape[1] // BLOCK
        scales = torch.stack((d, m)).view(2, num_groups, GROUP, num_blocks).permute(1, 3, 0, 2)
        scale_bytes = scales.contiguous().view(torch.uint8).view(num_groups, num_blocks, -1)
        self._packed = torch.cat((self._values_layout(q), scale_bytes), dim=-1).contiguous()
        self.nbytes = self._packed.numel()

    @staticmethod
    def _values_layout(q: torch.Tensor) -> torch.Tensor:
        """q [N, K] (whole groups) -> [groups, blocks, 256]: k within a block = 8 chunk + 4 nibble + j;
        byte (chunk, output, j) = low | high << 4."""
        num_groups, num_blocks = q.shape[0] // GROUP, q.shape[1] // BLOCK
        q = q.view(num_groups, GROUP, num_blocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        return (q[..., 0] | (q[..., 1] << 4)).reshape(num_groups, num_blocks, NIBBLE_BYTES)

    @staticmethod
    def _values(layout: torch.Tensor) -> torch.Tensor:
        """_values_layout's inverse: [groups, blocks, 256] -> q [groups * 16, blocks * 32]."""
        num_groups, num_blocks, _ = layout.shape
        nibbles = layout.reshape(num_groups, num_blocks, 4, GROUP, 4)
        q = torch.stack((nibbles & 15, nibbles >> 4), dim=-1)  # [g, b, chunk, output, j, nibble]
        return q.permute(0, 3, 1, 2, 5, 4).reshape(num_groups * GROUP, num_blocks * BLOCK)

    @property
    def scale_dtype(self) -> torch.dtype:
        """torch.float16 (320 bytes per 16 outputs x 32 inputs) or torch.float32 (384 bytes)."""
        return torch.float16 if self._kernel is self.KERNELS[torch.float16] else torch.float32

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored blocks: q [out, in] uint8 in 0..15, d and m [out, in / 32] in scale_dtype;
        from_blocks of them packs the same weight again."""
        num_groups, num_blocks, _ = self._packed.shape
        q = self._values(self._packed[..., : self.VALUE_BYTES])
        scale_bytes = self._packed[..., self.VALUE_BYTES :].contiguous()
        scales = scale_bytes.view(self.scale_dtype).view(num_groups, num_blocks, 2, GROUP)
        d, m = scales.permute(2, 0, 3, 1).reshape(2, num_groups * GROUP, num_blocks)
        num_out = self.shape[0]
        return q[:num_out], d[:num_out], m[:num_out]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the products compute with, d * q + m (for tests and references)."""
        q, d, m = self.blocks()
        weight = q.view(q.shape[0], -1, BLOCK).float() * d.float()[..., None] + m.float()[..., None]
        return weight.view(q.shape)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
        # x: [T, in] -> [T, out] float32. path: one of PATHS, to check every path gives the same bits.
        return self._kernel.run(self._packed, self.shape, x, bias, path)
