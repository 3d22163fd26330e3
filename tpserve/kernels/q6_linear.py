"""Linear layers with 6-bit weights, a scale per 16 inputs (GGUF's Q6_K, and Q3_K), and 8-bit inputs.

A weight is held in blocks of 32 inputs per output, each of two halves of 16: w = d * sc * (q - 32)
with q in 0..63, an int8 sub-scale sc per half and a float16 d per block (Q6_K's super-block d,
repeated for its 8 blocks of 32). A Q6_K tensor is served with its own values: every weight is an
exact float32 (11 significant bits times 7 times 5), so nothing is rounded twice. The packed layout
(tpserve/kernels/native/q6_linear.c) keeps q in 6 bits, 4 as the 4-bit layout's nibbles and 2 beside them:
0.875 bytes a weight, against the GGUF's 0.82. (A Q3_K tensor is the same form with q - 32 in -4..3
and sc in -32..31: served exactly too, at twice its GGUF's 0.43 bytes a weight.)
As for the other block weights (tpserve/kernels/q4_linear.py, tpserve/kernels/q8_linear.py, whose input
quantization and loops this kernel shares), each block's product is an exact int32 and its float epilogue is
fixed elementwise: a row has the same bits at any batch and on the AVX-512 VNNI, AVX2 and scalar paths. The C
kernel runs on one thread, whatever torch's count.

Why: a Q4_K_M GGUF keeps its head and some ffn_down and attn_v in Q6_K; rounded to 4 bits at load
they lose what the file kept. bench/q6_linear.py sets this kernel against float32, 4, 5 and 8 bits.
"""

from __future__ import annotations

import torch

from tpserve.kernels.block_weights import (
    BLOCK,
    GROUP,
    BlockKernel,
    check_block_shape,
    exact_half,
    half_up,
)
from tpserve.kernels.int8_linear import PackedWeight, QuantizeError
from tpserve.kernels.q4_linear import Q4Weight

HALF = BLOCK // 2  # inputs per sub-scale
# per (group, block): 16 outputs x 32 values' low 4 bits (the 4-bit layout), then their top 2 bits,
# then sc[16][2] int8 and d[16] float16
NIBBLE_BYTES, HIGH_BYTES = 256, 128
VALUES_BYTES = NIBBLE_BYTES + HIGH_BYTES
GROUP_BLOCK_BYTES = VALUES_BYTES + 2 * GROUP + 2 * GROUP  # 448
KERNEL = BlockKernel(
    "q6_linear", paths="tp_q6_paths", linear="tp_q6_linear", what="6-bit block kernel", lookup="tp_q6_rows"
)


def q6_available() -> str | None:
    """None where the 6-bit block kernel builds and runs here; else why not, in words."""
    return KERNEL.unavailable()


class Q6Weight(PackedWeight):
    """One [out, in] weight in 6-bit blocks; `__call__(x [T, in]) -> [T, out]` float32, and
    `rows(ids)` its dequantized rows (a tied embedding's lookup, as Q8Weight's)."""

    def __init__(self, weight: torch.Tensor):
        """Quantize a float weight symmetrically per half block, as Q6_K does but with d per block:
        d = absmax / (127 * 31) in float16 rounded up, sc = ceil(absmax of the half / (31 d)) (at most
        127), so q = round(w / (d sc)) + 32 lies in 1..63 against those very d and sc."""
        check_block_shape(weight, "6-bit")
        weight = weight.detach().float()
        blocks = weight.view(weight.shape[0], -1, 2, HALF)
        d = half_up(blocks.abs().amax(dim=(-2, -1)) / (127 * 31), "6-bit")
        tiny = torch.finfo(torch.float32).tiny
        sc = (blocks.abs().amax(dim=-1) / (31 * d.float().clamp_min(tiny))[..., None]).ceil_().clamp_(1, 127)
        step = (d.float()[..., None] * sc).clamp_min(tiny)[..., None]
        q = (blocks / step).round_().add_(32).clamp_(0, 63).to(torch.uint8).view(weight.shape)
        self._pack(q, sc.to(torch.int8).view(weight.shape[0], -1), d)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Q6Weight:
        return cls(weight)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> Q6Weight:
        """A checkpoint's own Q6_K blocks, packed as stored: q [out, in] uint8 in 0..63, sc [out, in / 16]
        int8, d [out, in / 32] (float16, or float32 or bfloat16 values that float16 holds exactly:
        others are refused by name), weight = d * sc * (q - 32). Nothing is rounded again."""
        if q.dtype != torch.uint8 or q.dim() != 2:
            raise QuantizeError(f"6-bit values must be uint8 [out, in], got {q.dtype} {list(q.shape)}")
        check_block_shape(q, "6-bit")
        halves = (q.shape[0], q.shape[1] // HALF)
        if sc.dtype != torch.int8 or tuple(sc.shape) != halves:
            raise QuantizeError(
                f"6-bit sub-scales sc must be int8 of shape {list(halves)} for values {list(q.shape)}, "
                f"got {sc.dtype} {list(sc.shape)}"
            )
        d = exact_half(d, "d", (q.shape[0], q.shape[1] // BLOCK), q.shape)
        if q.numel() and int(q.max()) > 63:
            raise QuantizeError(f"6-bit values must lie in 0..63, got one of {int(q.max())}")
        weight = cls.__new__(cls)
        weight._pack(q, sc, d)
        return weight

    def _pack(self, q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> None:
        # q: [N, K] uint8 0..63; sc: [N, K/16] int8; d: [N, K/32] float16 -> [groups, blocks, 448]
        # uint8 (q6_linear.c).
        self.shape, self.device = (q.shape[0], q.shape[1]), q.device
        q, sc, d = KERNEL.grouped(q, sc, d)
        num_groups, num_blocks = q.shape[0] // GROUP, q.shape[1] // BLOCK
        # The top bits' byte (half, output, j) holds inputs 16 half + 4i + j's in bits 2i, 2i + 1.
        top = (q >> 4).view(num_groups, GROUP, num_blocks, 2, 4, 4).permute(0, 2, 3, 1, 5, 4)
        top = (top << torch.arange(0, 8, 2, dtype=torch.uint8)).sum(dim=-1, dtype=torch.uint8)
        values = torch.cat(
            (Q4Weight._values_layout(q & 15), top.reshape(num_groups, num_blocks, HIGH_BYTES)), -1
        )
        subs = sc.view(num_groups, GROUP, num_blocks, 2).transpose(1, 2)  # [g, b, output, half]
        subs = subs.contiguous().view(torch.uint8).view(num_groups, num_blocks, 2 * GROUP)
        scales = d.view(num_groups, GROUP, num_blocks).transpose(1, 2).contiguous()
        scale_bytes = scales.view(torch.uint8).view(num_groups, num_blocks, 2 * GROUP)
        self._packed = torch.cat((values, subs, scale_bytes), dim=-1).contiguous()
        self.nbytes = self._packed.numel()

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored blocks: q [out, in] uint8 in 0..63, sc [out, in / 16] int8, d [out, in / 32]
        float16; from_blocks of them packs the same weight again."""
        num_groups, num_blocks, _ = self._packed.shape
        low = Q4Weight._values(self._packed[..., :NIBBLE_BYTES])
        top = self._packed[..., NIBBLE_BYTES:VALUES_BYTES].reshape(num_groups, num_blocks, 2, GROUP, 4, 1)
        top = (top >> torch.arange(0, 8, 2, dtype=torch.uint8)) & 3  # [g, b, half, output, j, i]
        top = top.permute(0, 3, 1, 2, 5, 4).reshape(num_groups * GROUP, num_blocks * BLOCK)
        q = low | (top << 4)
        subs = self._packed[..., VALUES_BYTES : VALUES_BYTES + 2 * GROUP].contiguous().view(torch.int8)
        sc = subs.view(num_groups, num_blocks, GROUP, 2).transpose(1, 2).reshape(num_groups * GROUP, -1)
        scales = self._packed[..., VALUES_BYTES + 2 * GROUP :].contiguous().view(torch.float16)
        d = scales.view(num_groups, num_blocks, GROUP).transpose(1, 2).reshape(num_groups * GROUP, num_blocks)
        num_out = self.shape[0]
        return q[:num_out], sc[:num_out], d[:num_out]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the products compute with, d * sc * (q - 32) (for tests and references)."""
        return dequantize_six_bit(*self.blocks())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [n] int64 output indices -> [n, in] float32, the rows of dequantize() (bit for bit),
        read from the packed weight itself: a tied Q6_K embedding's lookup."""
        return KERNEL.rows(self._packed, self.shape, ids)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
        # x: [T, in] -> [T, out] float32. path: one of PATHS, to check every path gives the same bits.
        return KERNEL.run(self._packed, self.shape, x, bias, path)


def dequantize_six_bit(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q [out, in] 0..63, sc [out, in / 16], d [out, in / 32] -> [out, in] float32 d * sc * (q - 32),
    each exact in float32 (as the `gguf` package computes (d * sc) * (q - 32))."""
    step = d.float().repeat_interleave(2, dim=1) * sc.float()  # [out, in / 16]
    values = (q.view(*step.shape, HALF).float() - 32) * step[..., None]
    return values.view(q.shape)
