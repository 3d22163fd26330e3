"""A checkpoint's fp8 weights (compressed-tensors float-quantized): a rank's slices, as stored
(`Fp8Values`), served in fp8 on a GPU that takes them and dequantized to float32 elsewhere.

A quantized linear `X` is stored as `X.weight` float8_e4m3fn [out, in] beside `X.weight_scale`, [1]
(strategy tensor) or [out, 1] (channel), in float32, float16 or bfloat16: weight = value * scale.
Each piece's rows or columns are read as stored with a scale per output row. On a GPU
(tpserve/ranks/packing.py fp8_on_gpu) they go to torch._scaled_mm as they are (tpserve/kernels/fp8_linear.py).
No CPU product here takes fp8, so on the CPU they are dequantized at load (tpserve/ranks/packing.py owned):
exact in float32 for a float16 or bfloat16 scale (a 4-bit significand times an 8- or 11-bit one), and rounded
once for a float32 scale, as compressed-tensors' own dequantize rounds at float32. From there `quantize`
serves them as it serves a float checkpoint's weights (tpserve/kernels/weight_formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tpserve.ranks.errors import ModelFileError

VALUE_DTYPE = "F8_E4M3"  # safetensors' name for float8_e4m3fn
SCALE_DTYPES = ("F32", "F16", "BF16")


def holds_fp8(handles: dict, files: dict[str, Path], stored: str, kinds: tuple[str, ...]) -> bool:
    """Whether the quantized weight `stored` (a weight_scale beside it) is fp8: the only kind the
    config declares, or (mixed) stored in float8_e4m3fn."""
    if "fp8" not in kinds or stored not in files:
        return False
    return kinds == ("fp8",) or handles[files[stored]].get_slice(stored).get_dtype() == VALUE_DTYPE


@dataclass
class Fp8Values:
    """A piece's fp8 weight as stored: values [out, in] float8_e4m3fn, scales [out] float32 (a
    tensor-wide scale repeated per row, so the parts of a fused product keep their own)."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: value * scale, the checkpoint's weight."""
        return self.values.float() * self.scales.reshape(-1, 1)


class StoredFp8:
    """One fp8 weight in a checkpoint; `read` takes a piece's slice, as StoredFloat's does."""

    def __init__(self, handles: dict, files: dict[str, Path], stored: str):
        self.name, self.path = stored, files[stored + "_scale"]
        self._values = handles[files[stored]].get_slice(stored)
        self._scales = handles[files[stored + "_scale"]].get_slice(stored + "_scale")
        self.shape = tuple(self._values.get_shape())
        if self._values.get_dtype() != VALUE_DTYPE or len(self.shape) != 2:
            raise self._error(
                f" is {self._values.get_dtype()} {list(self.shape)}, not {VALUE_DTYPE} [out, in] (fp8 weights)"
            )
        scale_shape = tuple(self._scales.get_shape())
        if self._scales.get_dtype() not in SCALE_DTYPES:
            raise self._error(f"_scale is {self._scales.get_dtype()}, not a float")
        self.per_channel = scale_shape in ((self.shape[0], 1), (self.shape[0],))
        if not self.per_channel and scale_shape not in ((1,), (1, 1)):
            raise self._error(
                f"_scale has shape {list(scale_shape)}, expected [1] (one scale) or [{self.shape[0]}, 1] "
                "(one per output channel)"
            )

    def _error(self, problem: str) -> ModelFileError:
        return ModelFileError(self.path, f"tensor {self.name}{problem}")

    def read(self, start: int = 0, end: int | None = None, columns: bool = False) -> Fp8Values:
        """Rows [start, end), or (columns) columns [start, end), as stored, with their rows' scales."""
        end = self.shape[1 if columns else 0] if end is None else end
        values = self._values[:, start:end] if columns else self._values[start:end]
        scales = self._scales[start:end] if self.per_channel and not columns else self._scales[:]
        scales = scales.float().reshape(-1, 1)  # [rows or 1, 1]
        if not (torch.isfinite(scales).all() and (scales > 0).all()):
            raise self._error("_scale holds a scale that is not a positive finite number")
        if not torch.isfinite(values.float()).all():
            raise self._error(" holds a value that is not finite (fp8 NaN)")
        return Fp8Values(values, scales.reshape(-1).expand(values.shape[0]).contiguous())
