"""Linear layers with float16 weights and float32 sums, a row's bits fixed by the code: the int8
format's down_proj, whose input has outlier channels that int8 rows cannot hold.

tpserve/kernels/native/fp16_linear.c adds each output's products in input order, one fused multiply-add at
a time, its vector lanes holding outputs side by side: a row's bits are the same at any batch, and
the same on the AVX-512, AVX2 and scalar paths, so on every x86 CPU alike. It replaces FBGEMM's
float16 product, which picks its kernel by the number of rows on an AVX2 CPU (an AMD EPYC), where a
row alone and the same row among 40 round differently. Where no C kernel builds, FBGEMM's product
serves in tiles of a fixed 16 rows (the one shape it then sees, as tpserve/kernels/linear.py does for the
BLAS); its bits are FBGEMM's there, and the start-up probe checks them.

The kernel runs on one thread, whatever torch's count. bench/fp16_linear.py times it against
FBGEMM's product and the float32 one.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from tpserve.kernels import native
from tpserve.kernels.int8_linear import ENGINE, PackedWeight, QuantizeError, int8_available

GROUP = 16  # outputs per group of the packed layout: [groups, in, 16] float16
PATHS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}  # fp16_linear.c's FP16_*
FALLBACK_ROWS = 16  # rows of every FBGEMM call where the C kernel does not build


@functools.cache
def _kernel():
    """fp16_linear.c's entry points, or None where no C kernel builds here."""
    try:
        library = native.load("fp16_linear")
    except native.NativeUnavailable:
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    library.tp_fp16_paths.restype, library.tp_fp16_paths.argtypes = i32, []
    # x, x's row stride, rows, in, packed weight, out features, out, path
    library.tp_fp16_linear.restype = i32
    library.tp_fp16_linear.argtypes = [p, i64, i32, i32, p, i32, p, i32]
    return library


def supported_paths() -> list[str]:
    """The C kernel's paths this CPU runs ("scalar" always among them); [] where it does not build."""
    kernel = _kernel()
    if kernel is None:
        return []
    paths = kernel.tp_fp16_paths()
    return [name for name, bit in PATHS.items() if bit and paths & (1 << bit)]


class Fp16Weight(PackedWeight):
    """One [out, in] weight in float16; `__call__(x [T, in]) -> [T, out]` float32."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise QuantizeError(f"float16 weights need [out, in], got {list(weight.shape)}")
        self.shape, self.device = tuple(weight.shape), weight.device
        half = weight.detach().float().half()
        self.nbytes = 2 * half.numel()
        if _kernel() is not None and weight.device.type == "cpu":
            num_out, num_in = self.shape
            groups = F.pad(half, (0, 0, 0, -num_out % GROUP)).view(-1, GROUP, num_in)
            self._packed = groups.transpose(1, 2).contiguous()  # [groups, in, 16]
            self._fbgemm = None
            return
        why_not = int8_available(weight.device)
        if why_not:
            raise QuantizeError(why_not)
        torch.backends.quantized.engine = ENGINE
        self._fbgemm = torch.ops.quantized.linear_prepack_fp16(half.float(), None)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the products compute with (for tests and references)."""
        if self._fbgemm is not None:
            return torch.ops.quantized.linear_unpack_fp16(self._fbgemm)[0]
        return self._packed.transpose(1, 2).reshape(-1, self.shape[1])[: self.shape[0]].float()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
        # x: [T, in] -> [T, out] float32. path: one of PATHS, to check every path gives the same bits.
        num_out, num_in = self.shape
        if x.dim() != 2 or x.shape[1] != num_in:
            raise ValueError(
                f"a [T, {num_in}] input expected by a {list(self.shape)} weight, got {list(x.shape)}"
            )
        x = x if x.dtype == torch.float32 else x.float()
        out = self._fbgemm_tiles(x) if self._fbgemm is not None else self._natively(x, path)
        return out.add_(bias) if bias is not None else out

    def _natively(self, x: torch.Tensor, path: str) -> torch.Tensor:
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; choose one of {', '.join(PATHS)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], self.shape[0])
        failed = _kernel().tp_fp16_linear(
            x.data_ptr(), x.stride(0), x.shape[0], self.shape[1], self._packed.data_ptr(), self.shape[0],
            out.data_ptr(), PATHS[path],
        )  # fmt: skip
        if failed:
            raise QuantizeError(f"the float16 kernel's {path} path does not run on this CPU")
        return out

    def _fbgemm_tiles(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        padded = F.pad(x, (0, 0, 0, -num_rows % FALLBACK_ROWS))
        tiles = [
            torch.ops.quantized.linear_dynamic_fp16(t, self._fbgemm) for t in padded.split(FALLBACK_ROWS)
        ]
        return torch.cat(tiles)[:num_rows]
