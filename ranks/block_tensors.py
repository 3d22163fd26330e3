"""Weights kept in GGUF blocks of 32 inputs (tpserve/gguf_blocks.py): a rank's slices, served as stored.

`X.weight` is stored as `X.weight_q4` (uint8 values 0..15) or `X.weight_q8` (int8 values), [out,
in], with `X.weight_d` and, for 4 bits, `X.weight_m` ([out, in / 32] float16, or float32 as a Q4_K
import writes them): weight = d * q + m.
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
from tpserve.ranks.errors import ModelFileError

SUFFIXES = ("_q4", "_q8")
SCALE_DTYPES = ("F16", "F32")  # safetensors' names; float32 holds a Q4_K's d * sc and -dmin * mn


@dataclass
class BlockValues:
    """One piece's weight in blocks: q [out, in] uint8 (4 bits) or int8 (8 bits), d and m [out, in / 32]
    float16 or float32."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None  # None: 8 bits, symmetric

    @property
    def bits(self) -> int:
        return 8 if self.m is None else 4

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: d * q + m, as the `gguf` package dequantizes the file's blocks."""
        values = self.q.float().view(*self.d.shape, BLOCK) * self.d.float().unsqueeze(-1)
        if self.m is not None:
            values += self.m.float().unsqueeze(-1)
        return values.view(self.q.shape)


def cat_blocks(parts: list[BlockValues]) -> BlockValues:
    """Blocks stacked by rows (q/k/v, gate/up), all of one width in bits; float16 scales beside float32
    ones become float32 (exactly)."""
    m = None if parts[0].m is None else torch.cat([p.m for p in parts])
    return BlockValues(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m)


def stored_blocks(files: dict[str, Path], name: str) -> str | None:
    """The values' stored name, where `name` is kept in blocks in this checkpoint."""
    return next((name + suffix for suffix in SUFFIXES if name + suffix in files), None)


class StoredBlocks:
    """One weight's blocks in a checkpoint; `read` takes a piece's slice, as StoredFloat's does."""

    def __init__(self, handles: dict, files: dict[str, Path], name: str, values_name: str):
        self.name, self.path = name, files[values_name]
        self.bits = bits = 4 if values_name.endswith("_q4") else 8
        scale_names = [name + "_d"] + ([name + "_m"] if bits == 4 else [])
        for scale in scale_names:
            if scale not in files:
                raise ModelFileError(self.path, f"tensor {values_name} has no {scale} beside it")
        self._q = handles[files[values_name]].get_slice(values_name)
        self._scales = [handles[files[s]].get_slice(s) for s in scale_names]
        self.shape = tuple(self._q.get_shape())
        want_dtype = "U8" if bits == 4 else "I8"
        if self._q.get_dtype() != want_dtype or len(self.shape) != 2 or self.shape[1] % BLOCK:
            raise ModelFileError(
                self.path,
                f"tensor {values_name} is {self._q.get_dtype()} {list(self.shape)}: {bits}-bit blocks "
                f"need {want_dtype} [out, in] with in a multiple of {BLOCK}",
            )
        blocks = [self.shape[0], self.shape[1] // BLOCK]
        for scale, stored in zip(scale_names, self._scales):
            if stored.get_dtype() not in SCALE_DTYPES or list(stored.get_shape()) != blocks:
                raise ModelFileError(
                    self.path,
                    f"tensor {scale} is {stored.get_dtype()} {stored.get_shape()}, not F16 or F32 {blocks}",
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
            scales = [s[:, start // BLOCK : end // BLOCK] for s in self._scales]
        else:
            q = self._q[start:end]
            scales = [s[start:end] for s in self._scales]
        if self.bits == 4 and q.numel() and int(q.max()) > 15:
            raise ModelFileError(
                self.path, f"tensor {self.name}_q4 holds {int(q.max())}, past 4 bits (0..15)"
            )
        if not all(torch.isfinite(scale).all() for scale in scales):
            raise ModelFileError(
                self.path, f"tensor {self.name}'s block scales hold a value that is not finite"
            )
        return BlockValues(q, scales[0], scales[1] if len(scales) > 1 else None)
