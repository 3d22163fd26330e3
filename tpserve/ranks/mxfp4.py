"""MXFP4 (OCP Microscaling, as gpt-oss's checkpoints store their experts), unpacked and decoded exactly.

A block is 32 values in 4-bit e2m1 sharing one e8m0 scale byte s, the power of two 2^(s - 127) (255 is
NaN): tpserve/kernels/mxfp4_linear.py, which serves the blocks as stored under `int4`. Stored:
`*_blocks` uint8 [..., rows, cols / 32, 16], two codes a byte, the element with the even index in the
low nibble; `*_scales` uint8 [..., rows, cols / 32]. Unpacked here to codes a byte each, they are
what a GGUF's MXFP4 import writes (tpserve/gguf_blocks.py, from its own nibble order), and both are
decoded by the kernel's one `dequantize_codes`.

Every value is some m * 2^k with m of at most two significant bits, so its float32 product is exact
(or infinite: a scale past 2^125); dequantized, it reaches the engine's dtype unrounded or is refused.
"""

from __future__ import annotations

import torch

from tpserve.kernels.mxfp4_linear import NAN_SCALE, dequantize_codes
from tpserve.ranks.block_tensors import MXFP4, BlockValues
from tpserve.ranks.errors import ModelFileError

BLOCK = 32  # values sharing a scale


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, where: str) -> BlockValues:
    """blocks: uint8 [rows, G, 16]; scales: uint8 [rows, G] -> the blocks as stored (codes a byte
    each), once every value is checked to reach `dtype` exactly, as dequantize_mxfp4 checks them: so
    any format can serve them, dequantized or not."""
    codes = _codes(blocks, scales, where)
    _checked(codes, scales, dtype, where)
    return BlockValues(codes, scales, None, bits=MXFP4)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, where: str
) -> torch.Tensor:
    """blocks: uint8 [rows, G, 16]; scales: uint8 [rows, G] -> [rows, G * 32] in dtype, exactly; a
    NaN scale, or a value dtype cannot hold, is refused naming `where`."""
    return _checked(_codes(blocks, scales, where), scales, dtype, where)


def _codes(blocks: torch.Tensor, scales: torch.Tensor, where: str) -> torch.Tensor:
    """blocks: uint8 [rows, G, 16] -> codes uint8 [rows, G * 32], a byte each, the low nibble first."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelFileError(
            where, f"MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ModelFileError(
            where,
            f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} (16 bytes a block)",
        )
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).view(scales.shape[0], -1)


def _checked(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """The codes' values in dtype, refused naming `where` where a scale is NaN or dtype does not hold
    a value exactly."""
    if bool((scales == NAN_SCALE).any()):
        raise ModelFileError(where, f"an MXFP4 scale is NaN ({NAN_SCALE})")
    exact = dequantize_codes(codes, scales)
    out = exact.to(dtype)
    if not bool(torch.isfinite(exact).all()) or not torch.equal(out.float(), exact):
        raise ModelFileError(
            where, f"MXFP4 values out of {dtype}'s exact range (a scale too large or too small)"
        )
    return out
