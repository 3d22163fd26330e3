"""Linear layers with 8-bit block weights and 8-bit inputs (GGUF's Q8_0 x Q8_1), and embedding rows
read from the same copy.

A weight is held in blocks of 32 inputs per output: w = d * q with q int8 and one float16 d per
block (kernels/block_scales.py), 1.0625 bytes a weight as in a Q8_0 GGUF. It serves a tied
embedding and head from one copy: `__call__` is the head's product, `rows(ids)` the embedding's
lookup, each row d * q exactly as `dequantize()` has it. As for the 4-bit weights
(kernels/q4_linear.py, whose input quantization this kernel shares), every input row is quantized
per block of 32 on its own, each block's product is an exact int32 and the float epilogue per block
is fixed elementwise in kernels/native/q8_linear.c: a row has the same bits at any batch and on the
AVX-512 VNNI, AVX2 and scalar paths. The C kernel runs on one thread, whatever torch's count.

Why 8 bits: SmolLM2's GGUF keeps its tied embedding and head in Q8_0, and requantizing them to 4
bits costs about 4% perplexity. bench/q8_linear.py sets this kernel against int8 (FBGEMM) and 4 bits.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from tpserve.kernels import native
from tpserve.kernels.block_scales import BLOCK, check_block_shape, exact_half, half_up
from tpserve.kernels.int8_linear import PackedWeight, QuantizeError
from tpserve.kernels.q4_linear import PATHS

GROUP = 16  # outputs per group of the packed layout
VALUES_BYTES = 512  # per (group, block): 16 outputs x 32 int8 values, then d[16] in float16
GROUP_BLOCK_BYTES = VALUES_BYTES + 2 * GROUP
INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


@cache
def _kernel():
    library = native.load("q8_linear")
    library.tp_q8_paths.restype = ctypes.c_int
    library.tp_q8_paths.argtypes = []
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    # x, x's row stride, rows, in, packed weight, out, scratch, out, path
    library.tp_q8_linear.restype = ctypes.c_int
    library.tp_q8_linear.argtypes = [p, i64, i32, i32, p, i32, p, p, i32]
    # packed weight, blocks per row, ids, number of ids, out
    library.tp_q8_rows.restype = None
    library.tp_q8_rows.argtypes = [p, i32, p, i32, p]
    return library


def q8_available() -> str | None:
    """None where the 8-bit block kernel builds and runs here; else why not, in words."""
    try:
        _kernel()
    except native.NativeUnavailable as err:
        return str(err)
    return None


def supported_paths() -> list[str]:
    """The kernel's code paths this CPU runs, "scalar" always among them."""
    paths = _kernel().tp_q8_paths()
    return [name for name, bit in PATHS.items() if bit and paths & (1 << bit)]


class Q8Weight(PackedWeight):
    """One [out, in] weight in 8-bit blocks; `__call__(x [T, in]) -> [T, out]` float32, and
    `rows(ids)` its dequantized rows (a tied embedding's lookup)."""

    def __init__(self, weight: torch.Tensor):
        """Quantize a float weight symmetrically per block of 32, as Q8_0 does: d = absmax / 127 in
        float16 rounded up (so no value passes 127 d), q = round(w / d) against that very d."""
        check_block_shape(weight, "8-bit")
        weight = weight.detach().float()
        blocks = weight.view(weight.shape[0], -1, BLOCK)
        d = half_up(blocks.abs().amax(dim=-1) / 127, "8-bit")
        steps = blocks / d.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        q = steps.round_().clamp_(-127, 127).to(torch.int8).view(weight.shape)
        self._pack(q, d)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Q8Weight:
        return cls(weight)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor) -> Q8Weight:
        """A checkpoint's own Q8_0 blocks, packed as stored: q [out, in] integers in -128..127 (int8,
        or a wider integer type), d [out, in / 32] (float16, or float32 or bfloat16 values that
        float16 holds exactly: others are refused by name), weight = d * q. Nothing is rounded again."""
        if q.dtype not in INTEGER_DTYPES or q.dim() != 2:
            raise QuantizeError(
                f"8-bit values must be signed integers (int8) [out, in], got {q.dtype} {list(q.shape)}"
            )
        check_block_shape(q, "8-bit")
        d = exact_half(d, "d", (q.shape[0], q.shape[1] // BLOCK), q.shape)
        if q.numel() and (int(q.min()) < -128 or int(q.max()) > 127):
            raise QuantizeError(f"8-bit values must lie in -128..127, got {int(q.min())}..{int(q.max())}")
        weight = cls.__new__(cls)
        weight._pack(q.to(torch.int8), d)
        return weight

    def _pack(self, q: torch.Tensor, d: torch.Tensor) -> None:
        # q: [N, K] int8; d: [N, K/32] float16 -> [groups, blocks, 544] uint8 (q8_linear.c).
        # The C kernel is all this weight needs (no FBGEMM).
        why_not = q8_available()
        if why_not:
            raise QuantizeError(why_not)
        num_out, num_in = q.shape
        self.shape = (num_out, num_in)
        self.device = q.device
        pad = -num_out % GROUP  # padding outputs: q and d zero, never written out
        q, d = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q.cpu(), d.cpu()))
        num_groups, num_blocks = q.shape[0] // GROUP, num_in // BLOCK
        # Within a block, input k = 4 chunk + j; byte (chunk, output, j).
        values = q.view(num_groups, GROUP, num_blocks, 8, 4).permute(0, 2, 3, 1, 4)
        values = values.reshape(num_groups, num_blocks, VALUES_BYTES).view(torch.uint8)
        scales = d.view(num_groups, GROUP, num_blocks).transpose(1, 2).contiguous()
        scale_bytes = scales.view(torch.uint8).view(num_groups, num_blocks, 2 * GROUP)
        self._packed = torch.cat((values, scale_bytes), dim=-1).contiguous()
        self.nbytes = self._packed.numel()

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored blocks: q [out, in] int8, d [out, in / 32] float16; from_blocks of them packs
        the same weight again."""
        num_groups, num_blocks, _ = self._packed.shape
        values = self._packed[..., :VALUES_BYTES].contiguous().view(torch.int8)
        q = values.view(num_groups, num_blocks, 8, GROUP, 4).permute(0, 3, 1, 2, 4)
        q = q.reshape(num_groups * GROUP, num_blocks * BLOCK)
        scales = self._packed[..., VALUES_BYTES:].contiguous().view(torch.float16)
        d = scales.view(num_groups, num_blocks, GROUP).transpose(1, 2).reshape(num_groups * GROUP, num_blocks)
        return q[: self.shape[0]], d[: self.shape[0]]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the products compute with, d * q (for tests and references)."""
        q, d = self.blocks()
        return (q.view(q.shape[0], -1, BLOCK).float() * d.float()[..., None]).view(q.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [n] int64 output indices -> [n, in] float32, the rows d * q of dequantize() (bit for
        bit), read from the packed weight itself: a tied embedding's lookup."""
        num_out, num_in = self.shape
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"row ids must be int64 [n], got {ids.dtype} {list(ids.shape)}")
        ids = ids.cpu().contiguous()
        if ids.numel():
            low, high = (int(v) for v in torch.aminmax(ids))
            if low < 0 or high >= num_out:
                raise ValueError(
                    f"row ids must lie in 0..{num_out - 1} for a {list(self.shape)} weight, got {low}..{high}"
                )
        out = torch.empty(ids.numel(), num_in)
        _kernel().tp_q8_rows(
            self._packed.data_ptr(), num_in // BLOCK, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        return out

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, path: str = "auto") -> torch.Tensor:
        # x: [T, in] -> [T, out] float32. path: one of PATHS, to check every path gives the same bits.
        num_out, num_in = self.shape
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; choose one of {', '.join(PATHS)}")
        if x.dim() != 2 or x.shape[1] != num_in:
            raise ValueError(
                f"a [T, {num_in}] input expected by a {list(self.shape)} weight, got {list(x.shape)}"
            )
        if x.device.type != "cpu":
            raise ValueError(f"the 8-bit block kernel runs on CPUs, not on {x.device.type}")
        x = x if x.dtype == torch.float32 else x.float()
        if x.stride(1) != 1:
            x = x.contiguous()
        num_rows = x.shape[0]
        out = torch.empty(num_rows, num_out)
        scratch = torch.empty(num_rows * (num_in + 8 * num_in // BLOCK), dtype=torch.uint8)
        failed = _kernel().tp_q8_linear(
            x.data_ptr(),
            x.stride(0),
            num_rows,
            num_in,
            self._packed.data_ptr(),
            num_out,
            scratch.data_ptr(),
            out.data_ptr(),
            PATHS[path],
        )
        if failed:
            raise QuantizeError(f"the 8-bit block kernel's {path} path does not run on this CPU")
        return out.add_(bias) if bias is not None else out
