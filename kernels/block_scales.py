"""Block scales in float16, as GGUF keeps them: checked exact for a checkpoint's, rounded once for ours.

The 4- and 8-bit block weights (kernels/q4_linear.py, kernels/q8_linear.py) keep one float16 scale
(and for 4 bits one float16 minimum) per block of 32 inputs; the kernels turn them into float32
exactly where they are used. A checkpoint's scales are taken as they are or refused: a float32 or
bfloat16 scale that float16 does not hold exactly would be rounded a second time, so it is refused
by name rather than kept in a wider layout (GGUF's Q4_0, Q4_1 and Q8_0 scales are all float16).
A weight quantized here rounds its scales outwards, so its blocks' range still covers every value.
"""

from __future__ import annotations

import torch

from tpserve.kernels.int8_linear import QuantizeError

BLOCK = 32  # inputs per block
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_UP, _DOWN = float("inf"), float("-inf")


def check_block_shape(weight: torch.Tensor, what: str) -> None:
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise QuantizeError(
            f"{what} weights need [out, in] with in a multiple of {BLOCK}, got {list(weight.shape)}"
        )


def exact_half(scales: torch.Tensor, name: str, blocks: tuple[int, int], values_shape) -> torch.Tensor:
    """A checkpoint's block scales [out, in / 32] as float16, refused by name unless float16 holds
    every one exactly (and it is finite)."""
    if scales.dtype not in SCALE_DTYPES or tuple(scales.shape) != blocks:
        raise QuantizeError(
            f"block scales {name} must be float32, float16 or bfloat16 of shape {list(blocks)} "
            f"for values {list(values_shape)}, got {scales.dtype} {list(scales.shape)}"
        )
    if not torch.isfinite(scales).all():
        raise QuantizeError(f"block scales {name} hold a value that is not finite")
    half = scales.to(torch.float16)
    inexact = half.float() != scales.float()
    if inexact.any():
        where = [int(i) for i in inexact.nonzero()[0]]
        raise QuantizeError(
            f"block scales {name} must be exact in float16 (the packed layout keeps float16), but "
            f"{name}{where} = {float(scales[tuple(where)])!r} is not"
        )
    return half


def half_up(x: torch.Tensor, what: str) -> torch.Tensor:
    """The least float16 >= each x (float32), refused by name beyond float16's range."""
    return _directed(x, _UP, what)


def half_down(x: torch.Tensor, what: str) -> torch.Tensor:
    """The greatest float16 <= each x (float32), refused by name beyond float16's range."""
    return _directed(x, _DOWN, what)


def _directed(x: torch.Tensor, toward: float, what: str) -> torch.Tensor:
    half = x.to(torch.float16)
    missed = half.float() < x if toward > 0 else half.float() > x
    half = torch.where(missed, torch.nextafter(half, torch.full_like(half, toward)), half)
    if not torch.isfinite(half).all():
        raise QuantizeError(
            f"{what} weights need block scales within float16's range (|scale| <= 65504), and finite "
            f"weights; got a block scale of {float(x[~torch.isfinite(half)][0])!r}"
        )
    return half
