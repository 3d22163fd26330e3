"""fp8 weights served in fp8 through `torch._scaled_mm`: a compressed-tensors fp8 checkpoint's
float8_e4m3fn values and per-channel (or one) scale, kept as stored, read 8 bits a weight.

Each input row is quantized to float8_e4m3fn by its own absmax (scale = absmax / 448, so a row's
numbers do not depend on the rows beside it), and the product applies the row's and the channel's
scales in its epilogue: out[t, o] = sum_i xq[t, i] * wq[o, i] * x_scale[t] * w_scale[o]. Row-wise
scales need a Hopper GPU (sm_90) or newer under CUDA; torch 2.13's CPU build runs the same call (what
the tests use).
"""

from __future__ import annotations

import torch

from tpserve.kernels.int8_linear import PackedWeight, QuantizeError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MULTIPLE = 16  # _scaled_mm's inputs and outputs in multiples of 16 on CUDA


def fp8_unfit(num_out: int, num_in: int, device: torch.device | str) -> str | None:
    """None where an [num_out, num_in] fp8 weight can take _scaled_mm on `device`; else why not."""
    kind = torch.device(device).type
    if kind == "cuda" and (num_out % MULTIPLE or num_in % MULTIPLE):
        return f"_scaled_mm wants dimensions in multiples of {MULTIPLE}, not [{num_out}, {num_in}]"
    if kind not in ("cuda", "cpu"):
        return f"_scaled_mm runs on CUDA (and the CPU), not on {kind}"
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, in] -> (float8 values [T, in], float32 scales [T, 1]), each row by its own absmax."""
    absmax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Weight(PackedWeight):
    """values [out, in] float8_e4m3fn, scales [out] (or one) float32; computes in and returns `dtype`."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        if values.dtype != FP8 or values.dim() != 2:
            raise QuantizeError(f"fp8 weights must be float8_e4m3fn [out, in], got {values.dtype}")
        why_not = fp8_unfit(*values.shape, values.device)
        if why_not:
            raise QuantizeError(f"a {list(values.shape)} fp8 weight cannot take _scaled_mm: {why_not}")
        self.values, self.shape, self.device, self.dtype = values, tuple(values.shape), values.device, dtype
        # [1, out]: the channel's scale in the epilogue (one scale read out to every channel)
        self.scales = scales.float().reshape(1, -1).expand(1, values.shape[0]).contiguous()
        self.nbytes = values.numel() + self.scales.numel() * 4

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, in] -> [T, out]; the weight's transpose is column-major, as _scaled_mm wants it
        xq, x_scale = quantize_rows(x)
        out = torch._scaled_mm(
            xq, self.values.t(), scale_a=x_scale, scale_b=self.scales, out_dtype=self.dtype
        )
        return out if bias is None else out + bias.to(out.dtype)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32: value * scale, the checkpoint's weight."""
        return self.values.float() * self.scales.reshape(-1, 1)
