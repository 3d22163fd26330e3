"""Linear layers with MXFP4 weights (gpt-oss's experts) and 8-bit inputs, the checkpoint's blocks as stored.

A block is 32 values in 4-bit e2m1 (a sign, two exponent bits of bias 1, one mantissa bit: 0, 0.5, 1,
1.5, 2, 3, 4, 6 and their negatives) sharing one e8m0 scale byte s, the power of two 2^(s - 127) (255
is NaN, refused). The kernel (tpserve/kernels/native/mxfp4_linear.c) keeps the codes and the scale
bytes as stored, 17 bytes per 32 weights (0.53 bytes a weight, against 0.75 for the same values in
5-bit blocks), and multiplies twice each value, a whole number in -12..12, by the input's 8-bit blocks
(the other block kernels' quantization, tpserve/kernels/native/block_quantize.h) as an exact int32 per
block; the float epilogue per block is fixed elementwise. So a row has the same bits alone or in any
batch, and the AVX-512 VNNI, AVX2 and scalar paths agree bit for bit. The C kernel runs on one thread.
"""

from __future__ import annotations

import torch

from tpserve.kernels.block_weights import BLOCK, GROUP, BlockKernel, check_block_shape
from tpserve.kernels.int8_linear import PackedWeight, QuantizeError
from tpserve.kernels.q4_linear import Q4Weight

NAN_SCALE = 255  # e8m0's NaN
NIBBLE_BYTES = 256  # per (group, block): the 4-bit layout's nibbles, then s[16]
GROUP_BLOCK_BYTES = NIBBLE_BYTES + GROUP  # 272
KERNEL = BlockKernel("mxfp4_linear", paths="tp_mxfp4_paths", linear="tp_mxfp4_linear", what="MXFP4 kernel")


def mxfp4_available() -> str | None:
    """None where the MXFP4 kernel builds and runs here; else why not, in words."""
    return KERNEL.unavailable()


def e2m1_values() -> torch.Tensor:
    """The 16 codes' values [16] float32, from the bit layout: sign (bit 3), exponent (bits 2-1),
    mantissa (bit 0); exponent 0 is subnormal (0.5 * mantissa)."""
    values = []
    for code in range(16):
        sign = -1.0 if code & 8 else 1.0
        exponent, mantissa = (code >> 1) & 3, code & 1
        magnitude = 0.5 * mantissa if exponent == 0 else (1.0 + 0.5 * mantissa) * 2.0 ** (exponent - 1)
        values.append(sign * magnitude)
    return torch.tensor(values, dtype=torch.float32)


def scale_values() -> torch.Tensor:
    """The e8m0 scales 2^(s - 127) for s = 0 .. 254 [255] float32 (each exact: 2^-127 is subnormal)."""
    return torch.tensor([2.0 ** (s - 127) for s in range(NAN_SCALE)], dtype=torch.float32)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes: uint8 [out, in] in 0..15; scales: uint8 [out, in / 32] in 0..254 -> [out, in] float32 on
    their device, each value e2m1 * 2^(s - 127) exactly (or infinite: a scale past 2^125)."""
    values = e2m1_values().to(codes.device)[codes.long()].view(*scales.shape, BLOCK)
    return (values * scale_values().to(codes.device)[scales.long()].unsqueeze(-1)).view(codes.shape)


class Mxfp4Weight(PackedWeight):
    """One [out, in] weight in MXFP4 blocks; `__call__(x [T, in]) -> [T, out]` float32."""

    BITS = "MXFP4"  # how messages name it

    def __init__(self, weight: torch.Tensor):
        """Quantize a float weight to MXFP4 (for tests and benchmarks: checkpoints come in it): per
        block of 32 the least scale 2^(s - 127) >= absmax / 6, then each value's nearest e2m1."""
        check_block_shape(weight, self.BITS)
        weight = weight.detach().float()
        if not torch.isfinite(weight).all():
            raise QuantizeError(f"{self.BITS} weights must be finite")
        blocks = weight.view(weight.shape[0], -1, BLOCK)
        # log2(0) = -inf: an all-zero block takes the least scale
        exponent = torch.log2(blocks.abs().amax(dim=-1) / 6).ceil().add(127).clamp(0, NAN_SCALE - 1)
        steps = blocks / scale_values()[exponent.long()].unsqueeze(-1)
        magnitudes = e2m1_values()[:8]
        # the nearest magnitude (ties to the smaller), its sign in bit 3
        codes = torch.bucketize(steps.abs(), (magnitudes[1:] + magnitudes[:-1]) / 2) | (steps < 0) << 3
        self._pack(codes.to(torch.uint8).view(weight.shape), exponent.to(torch.uint8))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Mxfp4Weight:
        return cls(weight)

    @classmethod
    def from_blocks(cls, codes: torch.Tensor, scales: torch.Tensor) -> Mxfp4Weight:
        """A checkpoint's own blocks, packed as stored: codes [out, in] uint8 in 0..15 (one e2m1 code
        each), scales [out, in / 32] uint8 in 0..254 (e8m0: 2^(s - 127)); a NaN scale (255) is refused."""
        if codes.dtype != torch.uint8 or codes.dim() != 2:
            raise QuantizeError(
                f"{cls.BITS} codes must be uint8 [out, in], got {codes.dtype} {list(codes.shape)}"
            )
        check_block_shape(codes, cls.BITS)
        blocks = [codes.shape[0], codes.shape[1] // BLOCK]
        if scales.dtype != torch.uint8 or list(scales.shape) != blocks:
            raise QuantizeError(
                f"{cls.BITS} scales must be uint8 {blocks} for codes {list(codes.shape)}, "
                f"got {scales.dtype} {list(scales.shape)}"
            )
        if codes.numel() and int(codes.max()) > 15:
            raise QuantizeError(f"{cls.BITS} codes must lie in 0..15, got one of {int(codes.max())}")
        if bool((scales == NAN_SCALE).any()):
            raise QuantizeError(f"an {cls.BITS} scale is NaN ({NAN_SCALE})")
        weight = cls.__new__(cls)
        weight._pack(codes, scales)
        return weight

    def _pack(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        # codes: [N, K] uint8 0..15; scales: [N, K/32] uint8 -> [groups, blocks, 272] uint8
        # (mxfp4_linear.c): the 4-bit weights' nibble layout, then the 16 outputs' scale bytes.
        self.shape, self.device = (codes.shape[0], codes.shape[1]), codes.device
        codes, scales = KERNEL.grouped(codes, scales)
        num_groups, num_blocks = codes.shape[0] // GROUP, codes.shape[1] // BLOCK
        scale_bytes = scales.view(num_groups, GROUP, num_blocks).transpose(1, 2)
        self._packed = torch.cat((Q4Weight._values_layout(codes), scale_bytes), dim=-1).contiguous()
        self.nbytes = self._packed.numel()

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored blocks: codes [out, in] uint8 in 0..15, scales [out, in / 32] uint8; from_blocks
        of them packs the same weight again."""
        num_groups, num_blocks, _ = self._packed.shape
        codes = Q4Weight._values(self._packed[..., :NIBBLE_BYTES])
        scales = self._packed[..., NIBBLE_BYTES:].transpose(1, 2).reshape(num_groups * GROUP, num_blocks)
        num_out = self.shape[0]
        return codes[:num_out], scales[:num_out]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the products compute with, e2m1 * 2^(s - 127) (for tests and references)."""
        return dequantize_codes(*self.blocks())

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
        # x: [T, in] -> [T, out] float32. path: one of PATHS, to check every path gives the same bits.
        return KERNEL.run(self._packed, self.shape, x, bias, path)
