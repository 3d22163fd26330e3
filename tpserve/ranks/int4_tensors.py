"""A checkpoint's own int4 weights (compressed-tensors pack-quantized, 4 bits): a rank's slices, as blocks of 32.

A quantized linear `X` is stored as `X.weight_packed` int32 [out, in / 8], value i of each int32 in
bits 4i..4i+3 as the unsigned nibble u = v + 8 (v in -8..7), with `X.weight_shape` = [out, in] and
`X.weight_scale` [out, in / G] (strategy group, G = group_size) or [out, 1] (channel, G = in) in
float16, bfloat16 or float32. An asymmetric scheme adds `X.weight_zero_point` int32 [ceil(out / 8),
in / G]: eight zero points to an int32 down each column, offset by 8 likewise. weight = scale *
(v - zp) = scale * (u - z), z = zp + 8 (8 where symmetric).

Each 32 inputs of a group are one of our 4-bit blocks (tpserve/kernels/q4_linear.py, weight = d * q + m) with
q = u, d = scale and m = -z * scale in float32. That is exact where compressed-tensors writes scales
in the model's float16 or bfloat16 (at most 11 significant bits times z <= 15), and for -8 * scale
in any float; then d * q + m is scale * (u - z) exactly, compressed-tensors' float32 dequantization
bit for bit. With float32 scales m = -z * scale may round once (relative 2^-24) where z is not a
power of two, and d * q + m rounds in float32: within an ulp or two of m of the library's float32
values, the file's q and d kept as they are. A weight whose groups are not whole blocks (group_size not a
multiple of 32; a channel weight whose input is not) is served dequantized instead: each value
scale * (u - z) rounded once in float32, what compressed-tensors' dequantize gives with float32
scales (exact for float16 and bfloat16 ones). A column-parallel piece reads its rows of the values,
scales and zero points (of these, the int32 rows holding them); a row-parallel piece its columns of
the values (the int32 columns holding them) and its groups' scales and zero points, and off the
block edges gets its columns dequantized. So a piece's blocks are the file's own, no more read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpserve.kernels.block_weights import BLOCK
from tpserve.ranks.block_tensors import BlockValues
from tpserve.ranks.errors import ModelFileError

VALUES_PER_INT32 = 8
SCALE_DTYPES = ("F32", "F16", "BF16")  # safetensors' names


def holds_int4(handles: dict, files: dict[str, Path], stored: str, kinds: tuple[str, ...]) -> bool:
    """Whether the quantized weight `stored` (a weight_scale beside it) is int4: the only width the
    config declares, or (int8 and int4 mixed) packed eight values to an int32."""
    if "int4" not in kinds or stored + "_packed" not in files or stored + "_shape" not in files:
        return False
    if kinds == ("int4",):
        return True
    shape = handles[files[stored + "_shape"]].get_tensor(stored + "_shape").tolist()
    packed = handles[files[stored + "_packed"]].get_slice(stored + "_packed").get_shape()
    return len(shape) == 2 and list(packed) == [shape[0], -(-shape[1] // VALUES_PER_INT32)]


class StoredInt4:
    """One int4 weight in a checkpoint; `read` takes a piece's slice, as StoredInt8's does."""

    def __init__(self, handles: dict, files: dict[str, Path], stored: str):
        self.name, self.path = stored, files[stored + "_scale"]
        for extra in ("_packed", "_shape"):
            if stored + extra not in files:
                raise self._error(f"_scale has no {stored}{extra} beside it (int4 is stored packed)")
        if stored + "_g_idx" in files:
            raise self._error("_g_idx: activation order (g_idx) is not supported")

        def slice_of(name: str):
            return handles[files[name]].get_slice(name)

        self.shape = tuple(handles[files[stored + "_shape"]].get_tensor(stored + "_shape").tolist())
        self._values, self._scales = slice_of(stored + "_packed"), slice_of(stored + "_scale")
        if len(self.shape) != 2:
            raise self._error(f"_shape is {list(self.shape)}, not [out, in]")
        num_out, num_in = self.shape
        wanted = [num_out, -(-num_in // VALUES_PER_INT32)]
        if self._values.get_dtype() != "I32" or list(self._values.get_shape()) != wanted:
            raise self._error(
                f"_packed is {self._values.get_dtype()} {list(self._values.get_shape())}, weight_shape "
                f"{list(self.shape)} implies I32 {wanted} (4 bits)"
            )
        scale_shape = list(self._scales.get_shape())
        if self._scales.get_dtype() not in SCALE_DTYPES:
            raise self._error(f"_scale is {self._scales.get_dtype()}, not a float")
        if (
            len(scale_shape) != 2
            or scale_shape[0] != num_out
            or not scale_shape[1]
            or num_in % scale_shape[1]
        ):
            raise self._error(
                f"_scale has shape {scale_shape}, expected [{num_out}, in / group_size] with in = {num_in}"
            )
        self.group_size = num_in // scale_shape[1]
        self._zeros = slice_of(stored + "_zero_point") if stored + "_zero_point" in files else None
        if self._zeros is not None:
            wanted = [-(-num_out // VALUES_PER_INT32), scale_shape[1]]
            if self._zeros.get_dtype() != "I32" or list(self._zeros.get_shape()) != wanted:
                raise self._error(
                    f"_zero_point is {self._zeros.get_dtype()} {list(self._zeros.get_shape())}, expected "
                    f"I32 {wanted} (packed by 8 along the outputs)"
                )

    def _error(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, f"tensor {self.name}{problem}")

    def read(
        self, start: int = 0, end: int | None = None, columns: bool = False
    ) -> BlockValues | torch.Tensor:
        """Rows [start, end), or (columns) columns [start, end), in blocks (or dequantized, as the
        module docstring says)."""
        end = self.shape[1 if columns else 0] if end is None else end
        rows, cols = ((0, self.shape[0]), (start, end)) if columns else ((start, end), (0, self.shape[1]))
        u = self._nibbles(rows, cols)  # [rows, cols] uint8 0..15
        first_group, last_group = cols[0] // self.group_size, -(-cols[1] // self.group_size)
        scales = self._scales[rows[0] : rows[1], first_group:last_group]  # [rows, groups]
        zeros = self._zero_points(rows, first_group, last_group)  # [rows, groups] float32
        return group_blocks(
            u, scales, zeros, cols, self.group_size, lambda problem: self._error("_scale " + problem)
        )

    def _nibbles(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        words, kept = packed_words(cols)
        return unpack_nibbles(self._values[rows[0] : rows[1], words])[:, kept]

    def _zero_points(self, rows: tuple[int, int], first_group: int, last_group: int) -> torch.Tensor:
        if self._zeros is None:
            return torch.full((rows[1] - rows[0], last_group - first_group), 8.0)
        words, kept = packed_words(rows)
        # [words, groups] int32, eight outputs to a word -> [groups, 8 * words] -> [outputs, groups]
        zeros = unpack_nibbles(self._zeros[words, first_group:last_group].t()).t()
        return zeros[kept].float()


def group_blocks(
    u: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, cols: tuple[int, int], group_size: int, error
) -> BlockValues | torch.Tensor:
    """Columns `cols` of a weight scale * (u - z) per group of `group_size` inputs: u [rows, cols]
    uint8 0..15, scales and zeros [rows, groups] (the groups `cols` touch), as blocks of 32 (d = scale,
    m = -z * scale in float32) where every block lies in one group, else dequantized in float32.
    `error(problem)` is the ModelFileError naming the scales' tensor, raised unless every scale is
    positive and finite."""
    scales = scales.float()
    if not (torch.isfinite(scales).all() and (scales > 0).all()):
        raise error("holds a scale that is not a positive finite number")
    group_of = torch.arange(*cols) // group_size - cols[0] // group_size  # per column
    if group_size % BLOCK == 0 and cols[0] % BLOCK == 0 and cols[1] % BLOCK == 0:
        block_groups = group_of[::BLOCK]
        d = scales[:, block_groups]  # [rows, cols / 32]
        return BlockValues(u, d, -(d * zeros[:, block_groups]))
    return scales[:, group_of] * (u.float() - zeros[:, group_of])


def packed_words(span: tuple[int, int]) -> tuple[slice, slice]:
    """The int32 words holding values span[0] .. span[1] - 1, eight to a word, and where those
    values lie among the words' unpacked ones."""
    first, last = span[0] // VALUES_PER_INT32, -(-span[1] // VALUES_PER_INT32)
    offset = first * VALUES_PER_INT32
    return slice(first, last), slice(span[0] - offset, span[1] - offset)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, k] int32 -> [n, 8k] uint8 in 0..15, value i of each int32 from bits 4i..4i+3 (as
    compressed-tensors' pack_to_int32 puts them, whatever the host's byte order)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 15).to(torch.uint8).reshape(packed.shape[0], -1)
