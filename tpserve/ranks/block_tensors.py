"""Weights kept in GGUF blocks of 32 inputs (tpserve/gguf_blocks.py): a rank's slices, served as stored.

`X.weight` is stored as `X.weight_q4` (uint8 values 0..15), `X.weight_q5` (0..31) or `X.weight_q8`
(int8 values), [out, in], with `X.weight_d` and, for 4 and 5 bits, `X.weight_m` ([out, in / 32]
float16, or float32 as a Q4_K or Q5_K import writes them): weight = d * q + m. A Q6_K (or Q3_K)
import's `X.weight_q6` (uint8 values 0..63) has `X.weight_sc` ([out, in / 16] int8) and
`X.weight_d` ([out, in / 256] float16, one a super-block, read out to one a block of 32):
weight = d * sc * (q - 32). A GGUF's MXFP4 (gpt-oss's experts) is `X.weight_mxfp4` (uint8 e2m1 codes
0..15, a byte each) with `X.weight_e8m0` ([out, in / 32] uint8 scale bytes 0..254): weight =
e2m1(code) * 2^(s - 127) (tpserve/kernels/mxfp4_linear.py).
A column-parallel piece reads its rows of all of them, a row-parallel piece its columns of the values
and the matching block columns of the scales, so a piece's blocks are the file's own. A piece whose
columns do not start and end on a block edge (a tiny model's; no shipped model's) gets its columns'
exact dequantized values instead, in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tpserve.kernels.block_weights import BLOCK
from tpserve.kernels.mxfp4_linear import NAN_SCALE, dequantize_codes
from tpserve.kernels.q6_linear import HALF, dequantize_six_bit
from tpserve.ranks.errors import ModelFileError

MXFP4 = "mxfp4"  # BlockValues.bits of MXFP4 blocks: e2m1 codes and e8m0 scale bytes
# the values' stored name's suffix, by their bits
SUFFIXES = {4: "_q4", 5: "_q5", 8: "_q8", 6: "_q6", MXFP4: "_mxfp4"}
SCALE_DTYPES = ("F16", "F32")  # safetensors' names; float32 holds a Q4_K's d * sc and -dmin * mn
SUPER_BLOCK = 256  # a Q6_K's inputs per stored d
MAX_VALUE = {4: 15, 5: 31, 6: 63, MXFP4: 15}  # unsigned values' range; 8-bit values are int8


@dataclass
class BlockValues:
    """One piece's weight in blocks: q [out, in] uint8 (4, 5 and 6 bits, and MXFP4's codes) or int8
    (8 bits), d and m [out, in / 32] float16 or float32 (MXFP4: d the uint8 scale bytes), and for 6
    bits sc [out, in / 16] int8."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None  # None: 8 or 6 bits, symmetric, and MXFP4
    sc: torch.Tensor | None = None  # 6 bits: weight = d * sc * (q - 32)
    bits: int | str = 4  # 4, 5, 6, 8 or MXFP4

    @property
    def shape(self) -> torch.Size:
        """[out, in], as the float weight's."""
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: d * q + m, d * sc * (q - 32) or e2m1(q) * 2^(d - 127), as the `gguf`
        package dequantizes the file's blocks."""
        if self.bits == MXFP4:
            return dequantize_codes(self.q, self.d)
        if self.sc is not None:
            return dequantize_six_bit(self.q, self.sc, self.d)
        values = self.q.float().view(*self.d.shape, BLOCK) * self.d.float().unsqueeze(-1)
        if self.m is not None:
            values += self.m.float().unsqueeze(-1)
        return values.view(self.q.shape)


def cat_blocks(parts: list[BlockValues]) -> BlockValues:
    """Blocks stacked by rows (q/k/v, gate/up), all of one width in bits; float16 scales beside float32
    ones become float32 (exactly)."""
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])
    sc = None if parts[0].sc is None else torch.cat([p.sc for p in parts])
    return BlockValues(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m, sc, parts[0].bits)


def _named(bits: int | str) -> str:
    return "MXFP4" if bits == MXFP4 else f"{bits}-bit"


def _width(bits: int | str) -> str:
    return "MXFP4's 4 bits" if bits == MXFP4 else f"{bits} bits"


def stored_blocks(files: dict[str, Path], name: str) -> str | None:
    """The values' stored name, where `name` is kept in blocks in this checkpoint."""
    return next((name + suffix for suffix in SUFFIXES.values() if name + suffix in files), None)


class StoredBlocks:
    """One weight's blocks in a checkpoint; `read` takes a piece's slice, as StoredFloat's does."""

    def __init__(self, handles: dict, files: dict[str, Path], name: str, values_name: str):
        self.name, self.path, self.values_name = name, files[values_name], values_name
        self.bits = bits = next(b for b, suffix in SUFFIXES.items() if values_name == name + suffix)
        # (name, safetensors dtypes, inputs per scale)
        scales = {
            4: [(name + "_d", SCALE_DTYPES, BLOCK), (name + "_m", SCALE_DTYPES, BLOCK)],
            5: [(name + "_d", SCALE_DTYPES, BLOCK), (name + "_m", SCALE_DTYPES, BLOCK)],
            6: [(name + "_d", ("F16",), SUPER_BLOCK), (name + "_sc", ("I8",), HALF)],
            8: [(name + "_d", SCALE_DTYPES, BLOCK)],
            MXFP4: [(name + "_e8m0", ("U8",), BLOCK)],
        }[bits]
        for scale, _, _ in scales:
            if scale not in files:
                raise ModelFileError(self.path, f"tensor {values_name} has no {scale} beside it")
        self._q = handles[files[values_name]].get_slice(values_name)
        self._scales = [handles[files[s]].get_slice(s) for s, _, _ in scales]
        self.shape = tuple(self._q.get_shape())
        want_dtype, width = ("I8", BLOCK) if bits == 8 else ("U8", SUPER_BLOCK if bits == 6 else BLOCK)
        if self._q.get_dtype() != want_dtype or len(self.shape) != 2 or self.shape[1] % width:
            raise ModelFileError(
                self.path,
                f"tensor {values_name} is {self._q.get_dtype()} {list(self.shape)}: {_named(bits)} blocks "
                f"need {want_dtype} [out, in] with in a multiple of {width}",
            )
        for (scale, dtypes, per), stored in zip(scales, self._scales):
            want = [self.shape[0], self.shape[1] // per]
            if stored.get_dtype() not in dtypes or list(stored.get_shape()) != want:
                raise ModelFileError(
                    self.path,
                    f"tensor {scale} is {stored.get_dtype()} {stored.get_shape()}, not {' or '.join(dtypes)} {want}",
                )

    def read(
        self, start: int = 0, end: int | None = None, columns: bool = False
    ) -> BlockValues | torch.Tensor:
        """Rows [start, end), or (columns) columns [start, end) and their blocks' scales (or, off
        the block edges, those columns dequantized)."""
        end = self.shape[1 if columns else 0] if end is None else end
        if columns:
            if start % BLOCK or end % BLOCK:
                first, last = start // BLOCK * BLOCK, -(-end // BLOCK) * BLOCK
                return self.read(first, last, columns=True).dequantize()[:, start - first : end - first]
            q = self._q[:, start:end]
            scales = [self._columns(s, start, end) for s in self._scales]
        else:
            q = self._q[start:end]
            scales = [s[start:end] for s in self._scales]
            if self.bits == 6:  # d per super-block, read out to one a block of 32
                scales[0] = scales[0].repeat_interleave(SUPER_BLOCK // BLOCK, dim=1)
        top = MAX_VALUE.get(self.bits)
        if top is not None and q.numel() and int(q.max()) > top:
            raise ModelFileError(
                self.path,
                f"tensor {self.values_name} holds {int(q.max())}, past {_width(self.bits)} (0..{top})",
            )
        if not all(torch.isfinite(scale).all() for scale in scales if scale.is_floating_point()):
            raise ModelFileError(
                self.path, f"tensor {self.name}'s block scales hold a value that is not finite"
            )
        if self.bits == MXFP4 and bool((scales[0] == NAN_SCALE).any()):
            raise ModelFileError(self.path, f"tensor {self.name}_e8m0 holds a NaN MXFP4 scale ({NAN_SCALE})")
        if self.bits == 6:
            return BlockValues(q, scales[0], None, scales[1], bits=6)
        return BlockValues(q, scales[0], scales[1] if len(scales) > 1 else None, bits=self.bits)

    def _columns(self, scale, start: int, end: int) -> torch.Tensor:
        """A scale tensor's columns for inputs [start, end) (on block edges): one a block of 32, or
        (a Q6_K's) one a sub-block of 16; its d, one a super-block, read out to one a block."""
        per = self.shape[1] // scale.get_shape()[1]
        if per <= BLOCK:
            return scale[:, start // per : end // per]
        ratio = per // BLOCK
        first = start // per
        blocks = scale[:, first : -(-end // per)].repeat_interleave(ratio, dim=1)
        return blocks[:, start // BLOCK - first * ratio : end // BLOCK - first * ratio]
