"""RMS norm, computed in float32 and returned in the input's dtype (as the reference models do).

Float32 rows on a CPU go through tpserve/kernels/native/rms_norm.c where it builds: one call, each row's
sum of squares in an order the code fixes (torch's own rms_norm runs six ops on a CPU, about 30 µs
for one 576-wide row). Elsewhere torch's.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from tpserve.kernels import native


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, D], weight: [D]. One fused call in float32; otherwise the reference's order: normalise
    # in float32, round to the input's dtype, then scale (Llama's); or, where the weight is float32
    # beside rows in another dtype (Gemma 3's and gpt-oss's norms: tpserve/ranks/weights.py keeps them),
    # scale in float32 and round once at the end, as those families' norms do.
    if x.dtype == torch.float32:
        if x.device.type == "cpu" and weight.dtype == torch.float32 and _native() is not None:
            return _rms_norm_natively(x, weight, eps)
        return F.rms_norm(x, weight.shape, weight, eps)
    if weight.dtype == torch.float32:
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


@functools.cache
def _native():
    try:
        entry = native.load("rms_norm").tp_rms_norm
    except native.NativeUnavailable:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    entry.restype, entry.argtypes = None, [p, i64, i64, i64, p, ctypes.c_float, p]
    return entry


def _rms_norm_natively(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    rows = x.reshape(-1, shape[-1]) if x.dim() != 2 else x  # q/k norms: [T, H, D] -> [T*H, D]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(rows.shape)
    _native()(
        rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), weight.data_ptr(), eps, out.data_ptr()
    )
    return out.view(shape)
