"""Linear layers with int8 (and float16) weights on x86 CPUs: FBGEMM's products, a row independent of the rest.

The weights are quantized once per output channel (symmetric, absmax / 127) and packed into
FBGEMM's layout. FBGEMM's dynamic product quantizes its input with one scale and zero point for the
whole batch, which would make a row's numbers depend on the rows beside it. So every row is first
divided by its own absmax, and one sentinel row holding +1 and -1 joins the batch: every batch then
spans exactly [-1, 1] and quantizes with the same scale and zero point, a row's integers are its
own, integer sums are exact in any order, and the float epilogue is elementwise. The output row is
multiplied back by its absmax. A row thus comes out bit for bit the same alone, in a decode round or
inside a long prompt, and the same at tp=1 and tp=2 (a column-parallel piece sees whole rows; a
row-parallel piece quantizes its own slice at either size). The start-up probe checks it here.
One layer stays out of int8: down_proj, whose input has outlier channels that one scale per row
rounds away; its weight goes to float16 (tpserve/kernels/fp16_linear.py, float32 sums), nearly lossless.

Why FBGEMM through torch's quantized ops (whose tensor API torch deprecates): on the x86 CPUs we
measured it is 4-11x faster than float32 F.linear at SmolLM2's shapes, while torch's own int8 and
int4 weight kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) are 4-50x slower than
float32 on an AVX2 machine (see README, "Quantized weights"). Devices without FBGEMM (a GPU, an Arm
CPU) are refused by name at start-up: serve them in float.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import warnings

import torch

from tpserve.kernels import native
from tpserve.kernels.machine import cpu_flags

ENGINE = "fbgemm"


@functools.cache
def reduce_range() -> bool:
    """Whether inputs go in 7 bits (0..127) rather than 8: on a CPU without AVX-512 VNNI.

    8 bits halve the rounding step (SmolLM2: +3.4% perplexity against +9.8% in 7 bits), and AVX-512
    VNNI (vpdpbusd) adds u8 x s8 products straight into int32. Without it FBGEMM adds each pair of
    products in int16 first (vpmaddubsw), which saturates past 32767: 2 x 255 x 127 can reach 64770.
    On an AVX2 CPU (an AMD EPYC, family 23) about 1 pair in 600 did, a 5% error on a product (FBGEMM's
    output is an emulation's with the saturated sums). In 7 bits a pair is at most 2 x 127 x 128 =
    32512: no sum saturates, every integer is exact, by construction."""
    return "avx512_vnni" not in cpu_flags()


class QuantizeError(ValueError):
    """A quantization this device or weight cannot have."""


def int8_available(device: torch.device | str = "cpu") -> str | None:
    """None where int8 weights run on `device`; else why not, in words."""
    if torch.device(device).type != "cpu":
        return f"int8 weights run on x86 CPUs (FBGEMM), not on {torch.device(device).type}"
    if ENGINE not in torch.backends.quantized.supported_engines:
        return f"int8 weights need FBGEMM, which this torch build lacks on this CPU ({torch.__version__})"
    return None


class PackedWeight:
    """One [out, in] weight packed for a product of its own (FBGEMM's, or tpserve/kernels/q4_linear.py's):
    `linear` dispatches on it, and a row is the same at any batch there, so no tiles."""

    shape: tuple[int, int]
    dtype = torch.float32  # what it computes in and returns
    device: torch.device
    nbytes: int  # what it holds


class FbgemmWeight(PackedWeight):
    def __init__(self, weight: torch.Tensor):
        why_not = int8_available(weight.device)
        if why_not:
            raise QuantizeError(why_not)
        self.shape = tuple(weight.shape)
        self.device = weight.device
        torch.backends.quantized.engine = ENGINE


class Int8Weight(FbgemmWeight):
    """In int8, one scale per output channel; each input row quantized by its own absmax."""

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        weight = weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        with warnings.catch_warnings():  # torch deprecates quantized tensors; FBGEMM's product stays
            warnings.simplefilter("ignore")
            zero_points = torch.zeros(self.shape[0], dtype=torch.long)
            self._pack(torch.quantize_per_channel(weight, scale.double(), zero_points, 0, torch.qint8))

    @classmethod
    def from_int8(cls, values: torch.Tensor, scales: torch.Tensor) -> Int8Weight:
        """A checkpoint's own int8 weight, packed as stored: values [out, in] int8, scales [out] (one
        per output channel, weight = values * scale). Nothing is rounded again: unpacked, it gives
        back these values and scales (in float32, which holds a float16 or bfloat16 scale exactly)."""
        if values.dtype != torch.int8 or values.dim() != 2 or scales.shape != values.shape[:1]:
            raise QuantizeError(
                f"int8 values [out, in] with one scale per output channel expected, got {values.dtype} "
                f"{list(values.shape)} with scales {list(scales.shape)}"
            )
        weight = cls.__new__(cls)
        FbgemmWeight.__init__(weight, values)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
            scales = scales.float().double()  # FBGEMM keeps float32 scales: round there first, once
            weight._pack(torch._make_per_channel_quantized_tensor(values, scales, zero_points, 0))
        return weight

    def _pack(self, quantized: torch.Tensor) -> None:
        # quantized: [out, in] qint8, per output channel, zero points 0
        self._packed = torch.ops.quantized.linear_prepack(quantized, None)
        # FBGEMM's packed layout is opaque: a byte a value and a float scale per output, about
        self.nbytes = self.shape[0] * (self.shape[1] + 4)
        self._sentinel = torch.zeros(1, self.shape[1])
        self._sentinel[0, :2] = torch.tensor([1.0, -1.0])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the products compute with (for tests and references)."""
        quantized, _ = torch.ops.quantized.linear_unpack(self._packed)
        return quantized.dequantize()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out] float32
        x = x if x.dtype == torch.float32 else x.float()
        if _native_rows() is not None and x.stride(1) == 1:
            rows, absmax = _rows_natively(x)
        else:
            absmax = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)
            rows = torch.cat((x / absmax, self._sentinel))
        out = torch.ops.quantized.linear_dynamic(rows, self._packed, reduce_range())[: x.shape[0]]
        out = out.mul_(absmax)
        return out.add_(bias) if bias is not None else out


@functools.cache
def _native_rows():
    """tpserve/kernels/native/int8_rows.c's entry, or None where no C kernel builds (the torch ops serve:
    the same bits, in five calls instead of one)."""
    try:
        entry = native.load("int8_rows").tp_int8_rows
    except native.NativeUnavailable:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    entry.restype, entry.argtypes = None, [p, i64, i64, i64, p, p]
    return entry


def _rows_natively(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] -> (x / its rows' absmax, then the sentinel row: [T + 1, in]; the absmax [T, 1])."""
    num_rows, num_cols = x.shape
    if num_rows <= _KEPT_ROWS:
        rows, absmax = _row_buffers(num_rows, num_cols, threading.get_ident())
    else:
        rows, absmax = torch.empty(num_rows + 1, num_cols), torch.empty(num_rows, 1)
    _native_rows()(x.data_ptr(), num_rows, num_cols, x.stride(0), rows.data_ptr(), absmax.data_ptr())
    return rows, absmax


_KEPT_ROWS = 64  # inputs of up to this many rows (a decode round's) reuse their scratch


@functools.lru_cache(maxsize=16)
def _row_buffers(num_rows: int, num_cols: int, thread: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A thread's scratch rows and absmax for one input shape, written afresh by every product: both
    are spent before the product returns (its output is a new tensor), and a decode round's shapes
    repeat, so keeping them saves two allocations a product."""
    return torch.empty(num_rows + 1, num_cols), torch.empty(num_rows, 1)
