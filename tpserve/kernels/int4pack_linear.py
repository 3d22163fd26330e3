"""4-bit weights on a GPU through torch's own int4 weight-only product (`_weight_int4pack_mm`, the
kernel torchao's Int4WeightOnly serves with): a GPTQ, AWQ or compressed-tensors checkpoint's
blocks, or a GGUF's Q4, read 4 bits a weight instead of bf16's 16.

Our blocks are weight = d * q + m over groups of 32 inputs, q unsigned 0..15 (tpserve/ranks/block_tensors.py,
tpserve/ranks/int4_tensors.py). torch's kernel computes weight = (q - 8) * scale + zero per group, with
scales_and_zeros [in / group, out, 2] in the input's dtype: scale = d, zero = m + 8 d. The values
are packed once at load, by torch's own converter: on CUDA from nibble pairs ([out, in / 2] uint8,
the even input in the high nibble, as torchao packs them), on the CPU (`_for_cpu`, the same
arithmetic; what the tests run) from [out, in] int32 values.

Not batch-invariant (the GPU's product tiles by the batch): served where batch_invariant is off.
"""

from __future__ import annotations

import torch

from tpserve.kernels.block_weights import BLOCK
from tpserve.kernels.int8_linear import PackedWeight, QuantizeError

GROUP = BLOCK  # inputs per scale: our blocks of 32 (the kernel takes 32, 64, 128 or 256)
MIDPOINT = 8  # the kernel's zero offset: weight = (q - 8) * scale + zero
OUT_MULTIPLE = 8  # CUDA's packed layout holds outputs in tiles of 8


def inner_k_tiles(num_in: int) -> int | None:
    """The packed layout's inner tiles for `num_in` inputs (it needs in % (tiles * 16) == 0): the
    widest of 8, 4, 2 that fits, None where none does."""
    return next((tiles for tiles in (8, 4, 2) if num_in % (tiles * 16) == 0), None)


def int4pack_unfit(num_out: int, num_in: int, device: torch.device | str) -> str | None:
    """None where a [num_out, num_in] 4-bit weight can be packed for `device`; else why not."""
    kind = torch.device(device).type
    if kind not in ("cuda", "cpu"):
        return f"torch's int4 product runs on CUDA (and the CPU), not on {kind}"
    if num_in % GROUP or inner_k_tiles(num_in) is None:
        return f"{num_in} inputs are not whole groups of {GROUP} and tiles of 32"
    if kind == "cuda" and num_out % OUT_MULTIPLE:
        return f"{num_out} outputs are not whole tiles of {OUT_MULTIPLE}"
    return None


def nibble_pairs(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] uint8 0..15 -> [out, in / 2] uint8, input 2i in the high nibble and 2i+1 in the
    low: what `_convert_weight_to_int4pack` (CUDA) reads."""
    return (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)


def scales_and_zeros(d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """d, m [out, in / 32] -> [in / 32, out, 2] in `dtype`: (d, m + 8 d), worked in float32 and
    rounded once."""
    d, m = d.float(), m.float()
    return torch.stack([d, m + MIDPOINT * d], dim=-1).transpose(0, 1).contiguous().to(dtype)


class Int4PackWeight(PackedWeight):
    """An [out, in] weight in 4-bit groups of 32, packed for torch's int4 weight-only product.
    Computes in `dtype` (bfloat16 on a GPU: the CUDA kernel takes bfloat16 rows) and returns it."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]):
        self.packed, self.scales, self.shape = packed, scales, shape
        self.device, self.dtype = packed.device, scales.dtype
        self.nbytes = packed.numel() * packed.element_size() + scales.numel() * scales.element_size()
        self._product = (
            torch._weight_int4pack_mm if self.device.type == "cuda" else torch._weight_int4pack_mm_for_cpu
        )

    @classmethod
    def from_blocks(
        cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype: torch.dtype = torch.bfloat16
    ) -> Int4PackWeight:
        """q [out, in] uint8 0..15, d and m [out, in / 32]: weight = d * q + m, on q's device."""
        if q.dtype != torch.uint8 or q.dim() != 2 or d.shape != (q.shape[0], q.shape[1] // GROUP):
            raise QuantizeError(f"4-bit blocks must be uint8 [out, in] with [out, in / {GROUP}] scales")
        why_not = int4pack_unfit(*q.shape, q.device)
        if why_not:
            raise QuantizeError(f"a {list(q.shape)} weight cannot take torch's int4 product: {why_not}")
        tiles = inner_k_tiles(q.shape[1])
        if q.device.type == "cuda":
            packed = torch._convert_weight_to_int4pack(nibble_pairs(q), tiles)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), tiles)
        return cls(packed, scales_and_zeros(d, m, dtype), tuple(q.shape))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out] in the weight's dtype
        out = self._product(x.to(self.dtype).contiguous(), self.packed, GROUP, self.scales)
        return out if bias is None else out + bias.to(out.dtype)
