"""GPTQ's (AutoGPTQ's v1, GPTQModel's v2) and AWQ's (AutoAWQ's GEMM) int4 weights, as blocks of 32.

GPTQ stores a quantized linear `X` as `X.qweight` int32 [in / 8, out], eight inputs to an int32
down each column (input 8w + j of word w in bits 4j..4j+3, an unsigned nibble q), `X.qzeros` int32
[groups, out / 8], eight outputs to an int32 along each row likewise (v1 stores each zero point
less one, z = stored + 1 in 1..16; v2 stores z itself), `X.scales` [groups, out] (float16 as
AutoGPTQ writes them; bfloat16 and float32 accepted), and `X.g_idx` int32 [in], each input's
group: i // group_size where desc_act is false, anything else refused by name (absent, it is taken
as that). Groups are ceil(in / group_size), group_size -1 meaning all the inputs. weight[o, i] =
scales[g, o] * (q[i, o] - z[g, o]) with g = i // group_size: AutoGPTQ's QuantLinear
(qlinear_cuda_old.py) computes it in float16, we in float32 (float16's rounding of ours). AWQ
stores `X.qweight` int32 [in, out / 8] and `X.qzeros` [groups, out / 8] packed along the outputs,
nibble i of word c holding output 8c + AWQ_ORDER[i], the zero points as they are (0..15), and
`X.scales` [groups, out]; the same formula (AutoAWQ's dequantize_gemm).

Each 32 inputs of a group are one of our 4-bit blocks (tpserve/kernels/q4_linear.py, weight = d * q + m), as
for a compressed-tensors int4 weight (tpserve/ranks/int4_tensors.py, whose group_blocks builds them): q as
stored, d = scale and m = -z * scale in float32, exact for a float16 or bfloat16 scale (11 significant
bits times z <= 16), so that d * q + m is scale * (q - z) exactly. Groups that are not whole blocks,
and a row-parallel piece off the block edges, are served dequantized in float32. A column-parallel
piece (outputs) reads its columns of GPTQ's qweight and of the scales and the int32 columns holding
its outputs of AWQ's qweight and of qzeros; a row-parallel piece (inputs) the int32 rows of GPTQ's
qweight holding its inputs, its rows of AWQ's, and its groups' rows of scales and qzeros. So a
piece's blocks are the file's own, no more read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpserve.ranks.block_tensors import BlockValues
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.int4_tensors import (
    SCALE_DTYPES,
    VALUES_PER_INT32,
    group_blocks,
    packed_words,
    unpack_nibbles,
)

# Nibble i of an AWQ int32 holds output 8c + AWQ_ORDER[i] (AutoAWQ's WQLinear_GEMM order_map).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_IN_ORDER = tuple(AWQ_ORDER.index(j) for j in range(VALUES_PER_INT32))  # output 8c + j's nibble


class StoredGptq:
    """One GPTQ int4 weight in a checkpoint (`prefix` + qweight, ...); `read` takes a piece's slice,
    as StoredInt4's does."""

    VALUES = "[in / 8, out]"  # qweight's layout, in words
    ZERO_OFFSET = 1  # v1 stores each zero point less one

    def __init__(self, handles: dict, files: dict[str, Path], prefix: str, group_size: int):
        self.name, self.path = prefix, files[prefix + "qweight"]
        for part in ("qzeros", "scales"):
            if prefix + part not in files:
                raise self._error(f"qweight has no {prefix}{part} beside it")

        def slice_of(name: str):
            return handles[files[name]].get_slice(name)

        self._values, self._scales = slice_of(prefix + "qweight"), slice_of(prefix + "scales")
        self._zeros = slice_of(prefix + "qzeros")
        values_shape = list(self._values.get_shape())
        if self._values.get_dtype() != "I32" or len(values_shape) != 2:
            raise self._error(f"qweight is {self._values.get_dtype()} {values_shape}, not I32 {self.VALUES}")
        self.shape = num_out, num_in = self._weight_shape(*values_shape)
        self.group_size = num_in if group_size == -1 else group_size
        num_groups = -(-num_in // self.group_size)
        scale_shape = list(self._scales.get_shape())
        if self._scales.get_dtype() not in SCALE_DTYPES or scale_shape != [num_groups, num_out]:
            raise self._error(
                f"scales is {self._scales.get_dtype()} {scale_shape}, expected a float "
                f"[{num_groups}, {num_out}] (in {num_in}, group_size {group_size})"
            )
        wanted = [num_groups, -(-num_out // VALUES_PER_INT32)]
        if self._zeros.get_dtype() != "I32" or list(self._zeros.get_shape()) != wanted:
            raise self._error(
                f"qzeros is {self._zeros.get_dtype()} {list(self._zeros.get_shape())}, expected I32 {wanted} "
                "(packed by 8 along the outputs)"
            )
        if prefix + "g_idx" in files:
            g_idx = handles[files[prefix + "g_idx"]].get_tensor(prefix + "g_idx")
            in_order = torch.arange(num_in) // self.group_size
            if g_idx.shape != in_order.shape or not torch.equal(g_idx.long(), in_order):
                raise self._error(
                    f"g_idx is not i // group_size ({self.group_size}): activation order is not supported"
                )

    @staticmethod
    def _weight_shape(num_words: int, num_out: int) -> tuple[int, int]:
        return num_out, num_words * VALUES_PER_INT32

    def _error(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, f"tensor {self.name}{problem}")

    def read(
        self, start: int = 0, end: int | None = None, columns: bool = False
    ) -> BlockValues | torch.Tensor:
        """Rows [start, end) (outputs), or (columns) columns [start, end) (inputs), of weight [out, in]
        in blocks (or dequantized, as the module docstring says)."""
        end = self.shape[1 if columns else 0] if end is None else end
        rows, cols = ((0, self.shape[0]), (start, end)) if columns else ((start, end), (0, self.shape[1]))
        first_group, last_group = cols[0] // self.group_size, -(-cols[1] // self.group_size)
        scales = self._scales[first_group:last_group, rows[0] : rows[1]].t()  # [rows, groups]
        return group_blocks(
            self._nibbles(rows, cols),
            scales,
            self._zero_points(rows, first_group, last_group),
            cols,
            self.group_size,
            lambda problem: self._error("scales " + problem),
        )

    def _nibbles(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """[rows, cols] uint8 0..15."""
        words, kept = packed_words(cols)
        # [words, rows] int32, eight inputs to a word -> [rows, 8 * words]
        return unpack_nibbles(self._values[words, rows[0] : rows[1]].t())[:, kept]

    def _zero_points(self, rows: tuple[int, int], first_group: int, last_group: int) -> torch.Tensor:
        """[rows, groups] float32: the stored zero points (plus ZERO_OFFSET)."""
        words, kept = packed_words(rows)
        zeros = self._outputs_in_order(unpack_nibbles(self._zeros[first_group:last_group, words]))
        return zeros[:, kept].t().float() + self.ZERO_OFFSET

    @staticmethod
    def _outputs_in_order(unpacked: torch.Tensor) -> torch.Tensor:
        """[n, 8 * words] nibbles of int32s packed along the outputs -> the outputs in order."""
        return unpacked


class StoredGptqV2(StoredGptq):
    """One GPTQ int4 weight in GPTQModel's v2 format: v1's, each zero point stored as it is (0..15)."""

    ZERO_OFFSET = 0


class StoredAwq(StoredGptq):
    """One AWQ (GEMM) int4 weight: qweight [in, out / 8] and qzeros packed along the outputs in
    AWQ_ORDER, zero points stored as they are."""

    VALUES = "[in, out / 8]"
    ZERO_OFFSET = 0

    @staticmethod
    def _weight_shape(num_in: int, num_words: int) -> tuple[int, int]:
        return num_words * VALUES_PER_INT32, num_in

    def _nibbles(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        words, kept = packed_words(rows)
        # [cols, words] int32, eight outputs to a word -> [cols, 8 * words] -> [rows, cols]
        values = self._outputs_in_order(unpack_nibbles(self._values[cols[0] : cols[1], words]))
        return values[:, kept].t().contiguous()

    @staticmethod
    def _outputs_in_order(unpacked: torch.Tensor) -> torch.Tensor:
        order = torch.arange(unpacked.shape[1]).view(-1, VALUES_PER_INT32)[:, list(AWQ_IN_ORDER)]
        return unpacked[:, order.reshape(-1)]
