"""A checkpoint's own int8 weights (compressed-tensors): a rank's slices read as stored
(tpserve/ranks/packing.py packs them).

A quantized linear `X` is stored as `X.weight` int8 [out, in] (int-quantized) or as `X.weight_packed`
int32 [out, ceil(in / 4)] holding four values each, value i in bits 8i..8i+7 offset by +128, with
`X.weight_shape` = [out, in] (pack-quantized, 8 bits); beside it `X.weight_scale` [out, 1], and
weight = value * scale. A column-parallel piece reads its rows of both; a row-parallel piece reads
its columns of the values (of a packed tensor: the int32 columns holding them) and the whole scale.
Nothing is dequantized: the product computes with the file's integers and scales.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tpserve.ranks.errors import ModelFileError

VALUES_PER_INT32 = 4
# Weights a checkpoint may ship quantized (int8, and the int4 and fp8 readers beside this one): the
# linear layers, Mixtral's experts' (`block_sparse_moe.experts.N.w1/w2/w3`, which GPTQ and
# compressed-tensors quantize as the other projections) and the head; not the embedding (a lookup),
# nor a router or a gate (tpserve/ranks/weights.py refuses those quantized by name).
LINEAR_LEAVES = ("_proj.weight",)
MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
HEAD = "lm_head.weight"


@dataclass
class Int8Values:
    """One piece's int8 weight: values [out, in] int8 and one float32 scale per output row."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: value * scale, the checkpoint's weight."""
        return self.values.float() * self.scales.reshape(-1, 1)


class StoredInt8:
    """One int8 weight in a checkpoint, `stored` + "_scale" beside it; `read` takes a piece's slice.

    handles: file -> open safetensors file; files: tensor name -> file (a sharded checkpoint may
    put a weight and its scale in different files)."""

    def __init__(self, handles: dict, files: dict[str, Path], stored: str):
        self.name, self.path = stored, files[stored + "_scale"]
        if stored not in files and stored + "_packed" not in files:
            raise self._error(f" has a weight_scale but neither {stored} nor {stored}_packed")
        self.packed = stored not in files
        if self.packed and stored + "_shape" not in files:
            raise self._error("_packed has no weight_shape beside it")
        for extra, what in (("_g_idx", "activation order (g_idx)"), ("_zero_point", "zero points")):
            if stored + extra in files and (
                extra == "_g_idx" or handles[files[stored + extra]].get_tensor(stored + extra).any()
            ):
                raise self._error(f"{extra}: {what} not supported, only symmetric int8")

        def slice_of(name: str):
            return handles[files[name]].get_slice(name)

        self._values = slice_of(stored + ("_packed" if self.packed else ""))
        self._scales = slice_of(stored + "_scale")
        stored_shape, dtype = tuple(self._values.get_shape()), self._values.get_dtype()
        if self.packed:
            self.shape = tuple(slice_of(stored + "_shape")[:].tolist())
            wanted = (self.shape[0], -(-self.shape[1] // VALUES_PER_INT32)) if len(self.shape) == 2 else None
            if dtype != "I32" or stored_shape != wanted:
                raise self._error(
                    f"_packed is {dtype} {list(stored_shape)}, weight_shape {list(self.shape)} implies I32 {list(wanted or ())}"
                )
        else:
            self.shape = stored_shape
            if dtype != "I8":
                raise self._error(f" is {dtype}, but its weight_scale declares int8")
        scale_shape = tuple(self._scales.get_shape())
        if scale_shape not in ((self.shape[0], 1), (self.shape[0],)):
            raise self._error(
                f"_scale has shape {list(scale_shape)}, expected [{self.shape[0]}, 1] (one scale per output channel)"
            )
        if self._scales.get_dtype() not in ("F32", "F16", "BF16"):
            raise self._error(f"_scale is {self._scales.get_dtype()}, not a float")

    def _error(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, f"tensor {self.name}{problem}")

    def read(self, start: int = 0, end: int | None = None, columns: bool = False) -> Int8Values:
        """Rows [start, end) with their scales, or (columns) columns [start, end) with every scale.
        The parts may be views into safetensors' buffers (the caller copies them out)."""
        end = self.shape[1 if columns else 0] if end is None else end
        if columns:
            scales = self._scales[:]
            values = self._packed_columns(start, end) if self.packed else self._values[:, start:end]
        else:
            scales = self._scales[start:end]
            values = (
                _unpack(self._values[start:end], self.shape[1]) if self.packed else self._values[start:end]
            )
        scales = scales.reshape(-1).float()
        if not (torch.isfinite(scales).all() and (scales > 0).all()):
            raise self._error("_scale holds a scale that is not a positive finite number")
        return Int8Values(values, scales)

    def _packed_columns(self, start: int, end: int) -> torch.Tensor:
        first, last = start // VALUES_PER_INT32, -(-end // VALUES_PER_INT32)
        values = _unpack(self._values[:, first:last], (last - first) * VALUES_PER_INT32)
        offset = first * VALUES_PER_INT32
        return values[:, start - offset : end - offset]


def may_be_int8(name: str) -> bool:
    return name.endswith(LINEAR_LEAVES) or name == HEAD or MIXTRAL_EXPERT.search(name) is not None


def _unpack(packed: torch.Tensor, num_columns: int) -> torch.Tensor:
    # packed: [out, n] int32 -> [out, num_columns] int8 (the first num_columns of 4n)
    shifts = torch.arange(0, 32, 8, dtype=torch.int32)
    unsigned = (packed.unsqueeze(-1) >> shifts) & 0xFF  # [out, n, 4], value i at bits 8i
    return (unsigned - 128).to(torch.int8).reshape(packed.shape[0], -1)[:, :num_columns]
