"""MXFP4 (OCP Microscaling, as gpt-oss's checkpoints store their experts), decoded exactly.

A block is 32 values in 4-bit e2m1 (a sign, two exponent bits of bias 1, one mantissa bit: 0, 0.5,
1, 1.5, 2, 3, 4, 6 and their negatives) sharing one e8m0 scale byte s, the power of two 2^(s - 127)
(255 is NaN). Stored: `*_blocks` uint8 [..., rows, cols / 32, 16], two values a byte, the element
with the even index in the low nibble; `*_scales` uint8 [..., rows, cols / 32].

Every value is some m * 2^k with m of at most two significant bits, so its float32 product is exact
(or infinite: a scale past 2^125); it reaches the engine's dtype unrounded or is refused.

The same values are also five-bit blocks (GGUF's Q5_0 layout, tpserve/kernels/q5_linear.py) without a
rounding: q = 2 m + 16 in 4..28, d = 2^(k - 1), and the minimum -16 d; so `int4` serves MXFP4
experts as stored, 6 bits a weight with float16 scales (float32 where a scale is out of its range).
"""

from __future__ import annotations

import torch

from tpserve.kernels.block_weights import holds_in_half
from tpserve.ranks.block_tensors import BlockValues
from tpserve.ranks.errors import ModelFileError

BLOCK = 32  # values sharing a scale
NAN_SCALE = 255


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


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, where: str
) -> torch.Tensor:
    """blocks: uint8 [rows, G, 16]; scales: uint8 [rows, G] -> [rows, G * 32] in dtype, exactly; a
    NaN scale, or a value dtype cannot hold, is refused naming `where`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelFileError(
            where, f"MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ModelFileError(
            where,
            f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} (16 bytes a block)",
        )
    if bool((scales == NAN_SCALE).any()):
        raise ModelFileError(where, "an MXFP4 scale is NaN (255)")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [rows, G, 16, 2]: low nibble first
    values = e2m1_values()[codes].view(*scales.shape, BLOCK)  # [rows, G, 32]
    exact = values * scale_values()[scales.long()].unsqueeze(-1)
    out = exact.to(dtype)
    if not bool(torch.isfinite(exact).all()) or not torch.equal(out.float(), exact):
        raise ModelFileError(
            where, f"MXFP4 values out of {dtype}'s exact range (a scale too large or too small)"
        )
    return out.view(scales.shape[0], -1)


def mxfp4_as_five_bit(blocks: torch.Tensor, scales: torch.Tensor) -> BlockValues | None:
    """blocks: uint8 [rows, G, 16]; scales: uint8 [rows, G] (already checked by dequantize_mxfp4) ->
    the same values as 5-bit blocks, q [rows, G * 32] and d, m [rows, G]; None where a minimum is
    past float32 (a scale of 2^125 or more)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long().view(scales.shape[0], -1)
    q = (2 * e2m1_values()[codes] + 16).to(torch.uint8)  # 2 m + 16: whole, 4..28
    d = scale_values()[scales.long()] / 2  # 2^(k - 1), exact (2^-128 is a float32 subnormal)
    m = d * -16
    if not bool(torch.isfinite(m).all()):
        return None
    if holds_in_half(d) and holds_in_half(m):
        d, m = d.half(), m.half()
    return BlockValues(q, d, m, bits=5)
