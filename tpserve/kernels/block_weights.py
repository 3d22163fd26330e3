"""What the block weights share: their block scales, and calling their C kernels.

The 4-, 5- and 8-bit block weights (tpserve/kernels/q4_linear.py, q5_linear.py, q8_linear.py) keep one scale
(and for 4 and 5 bits one minimum) per block of 32 inputs, in float16 (the 6-bit weights of
tpserve/kernels/q6_linear.py add an int8 sub-scale per 16 inputs); the kernels turn them into float32 exactly
where they are used. A checkpoint's scales are taken as they are, never rounded a second time: the
8-bit weight refuses by name a float32 or bfloat16 scale that float16 does not hold exactly (GGUF's
Q8_0 scales are float16), and the 4-bit weight keeps such scales in a float32 layout instead (GGUF's
Q4_K: d * sc and -dmin * mn per block, exact in float32 only). A weight quantized here rounds its
scales outwards to float16, so its blocks' range still covers every value. The MXFP4 weights
(tpserve/kernels/mxfp4_linear.py) keep their checkpoint's e8m0 scale bytes, powers of two, as bytes.

Every kernel is built from one set of loops (tpserve/kernels/native/block_tiles.h) with the same entry
points, so one `BlockKernel` loads any of them, checks a product's arguments and runs it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from tpserve.kernels import native
from tpserve.kernels.int8_linear import QuantizeError

BLOCK = 32  # inputs per block
GROUP = 16  # outputs per group of the packed layouts
PATHS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512_vnni": 3}  # block_quantize.h's PATH_*
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_UP, _DOWN = float("inf"), float("-inf")


def check_block_shape(weight: torch.Tensor, what: str) -> None:
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise QuantizeError(
            f"{what} weights need [out, in] with in a multiple of {BLOCK}, got {list(weight.shape)}"
        )


def block_scales(scales: torch.Tensor, name: str, blocks: tuple[int, int], values_shape) -> torch.Tensor:
    """A checkpoint's block scales [out, in / 32] as float32 (exact: float32 holds every float16 and
    bfloat16), refused by name unless of one of SCALE_DTYPES, of shape `blocks`, and finite."""
    if scales.dtype not in SCALE_DTYPES or tuple(scales.shape) != blocks:
        raise QuantizeError(
            f"block scales {name} must be float32, float16 or bfloat16 of shape {list(blocks)} "
            f"for values {list(values_shape)}, got {scales.dtype} {list(scales.shape)}"
        )
    if not torch.isfinite(scales).all():
        raise QuantizeError(f"block scales {name} hold a value that is not finite")
    return scales.float()


def holds_in_half(scales: torch.Tensor) -> bool:
    """Whether float16 holds every one of these finite float32 scales exactly (in range included)."""
    return torch.equal(scales.to(torch.float16).float(), scales)


def exact_half(scales: torch.Tensor, name: str, blocks: tuple[int, int], values_shape) -> torch.Tensor:
    """A checkpoint's block scales [out, in / 32] as float16, refused by name unless float16 holds
    every one exactly (and it is finite)."""
    scales = block_scales(scales, name, blocks, values_shape)
    half = scales.to(torch.float16)
    inexact = half.float() != scales.float()
    if inexact.any():
        where = [int(i) for i in inexact.nonzero()[0]]
        raise QuantizeError(
            f"block scales {name} must be exact in float16 (the packed layout keeps float16), but "
            f"{name}{where} = {float(scales[tuple(where)])!r} is not"
        )
    return half


def half_up(x: torch.Tensor, what: str) -> torch.Tensor:
    """The least float16 >= each x (float32), refused by name beyond float16's range."""
    return _directed(x, _UP, what)


def half_down(x: torch.Tensor, what: str) -> torch.Tensor:
    """The greatest float16 <= each x (float32), refused by name beyond float16's range."""
    return _directed(x, _DOWN, what)


def _directed(x: torch.Tensor, toward: float, what: str) -> torch.Tensor:
    half = x.to(torch.float16)
    missed = half.float() < x if toward > 0 else half.float() > x
    half = torch.where(missed, torch.nextafter(half, torch.full_like(half, toward)), half)
    if not torch.isfinite(half).all():
        raise QuantizeError(
            f"{what} weights need block scales within float16's range (|scale| <= 65504), and finite "
            f"weights; got a block scale of {float(x[~torch.isfinite(half)][0])!r}"
        )
    return half


@dataclass(frozen=True)
class BlockKernel:
    """The block kernel tpserve/kernels/native/<source>.c: its entry points `paths` (the paths this CPU runs,
    a bit each), `linear` (block_tiles.h's block_linear) and, where it has one, `lookup` (a weight's
    rows dequantized, for an embedding that reads the head's copy); `what` names it in messages."""

    source: str
    paths: str
    linear: str
    what: str
    lookup: str | None = None

    def library(self) -> ctypes.CDLL:
        return _library(self.source, self.paths, self.linear, self.lookup)

    def unavailable(self) -> str | None:
        """None where the kernel builds and runs here; else why not, in words."""
        try:
            self.library()
        except native.NativeUnavailable as err:
            return str(err)
        return None

    def grouped(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """A weight's [out, ...] tensors (its values and scales) on the CPU, padded with zero outputs to
        whole groups of 16 for packing (the padding outputs are never written out); refused by name
        where the kernel does not build here."""
        why_not = self.unavailable()
        if why_not:
            raise QuantizeError(why_not)
        pad = -tensors[0].shape[0] % GROUP
        return [torch.nn.functional.pad(t.cpu(), (0, 0, 0, pad)) for t in tensors]

    def supported_paths(self) -> list[str]:
        """The kernel's code paths this CPU runs, "scalar" always among them."""
        paths = getattr(self.library(), self.paths)()
        return [name for name, bit in PATHS.items() if bit and paths & (1 << bit)]

    def run(
        self,
        packed: torch.Tensor,
        shape: tuple[int, int],
        x: torch.Tensor,
        bias: torch.Tensor | None,
        path: str,
    ) -> torch.Tensor:
        """x: [T, in] -> [T, out] float32 times the packed [out, in] weight, on `path` (one of PATHS,
        to check every path gives the same bits)."""
        num_out, num_in = shape
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; choose one of {', '.join(PATHS)}")
        if x.dim() != 2 or x.shape[1] != num_in:
            raise ValueError(f"a [T, {num_in}] input expected by a {list(shape)} weight, got {list(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"the {self.what} runs on CPUs, not on {x.device.type}")
        x = x if x.dtype == torch.float32 else x.float()
        if x.stride(1) != 1:
            x = x.contiguous()
        num_rows = x.shape[0]
        out = torch.empty(num_rows, num_out)
        # Per row: qa (in bytes), then da (4 bytes a block) and ms or sa (4) or sh (8), as block_linear
        # reads them.
        scratch = torch.empty(num_rows * (num_in + 12 * num_in // BLOCK), dtype=torch.uint8)
        failed = getattr(self.library(), self.linear)(
            x.data_ptr(),
            x.stride(0),
            num_rows,
            num_in,
            packed.data_ptr(),
            num_out,
            scratch.data_ptr(),
            out.data_ptr(),
            PATHS[path],
        )
        if failed:
            raise QuantizeError(f"the {self.what}'s {path} path does not run on this CPU")
        return out.add_(bias) if bias is not None else out

    def rows(self, packed: torch.Tensor, shape: tuple[int, int], ids: torch.Tensor) -> torch.Tensor:
        """ids: [n] int64 output indices -> [n, in] float32, the packed weight's rows as its
        dequantize() has them (bit for bit), read from the packed weight itself by `lookup`."""
        num_out, num_in = shape
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"row ids must be int64 [n], got {ids.dtype} {list(ids.shape)}")
        ids = ids.cpu().contiguous()
        if ids.numel():
            low, high = (int(v) for v in torch.aminmax(ids))
            if low < 0 or high >= num_out:
                raise ValueError(
                    f"row ids must lie in 0..{num_out - 1} for a {list(shape)} weight, got {low}..{high}"
                )
        out = torch.empty(ids.numel(), num_in)
        getattr(self.library(), self.lookup)(
            packed.data_ptr(), num_in // BLOCK, ids.data_ptr(), ids.numel(), out.data_ptr()
        )
        return out


@cache
def _library(source: str, paths_name: str, linear_name: str, lookup_name: str | None) -> ctypes.CDLL:
    library = native.load(source)
    paths = getattr(library, paths_name)
    paths.restype, paths.argtypes = ctypes.c_int, []
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    linear = getattr(library, linear_name)
    linear.restype = ctypes.c_int
    # x, x's row stride, rows, in, packed weight, out, scratch, out, path
    linear.argtypes = [p, i64, i32, i32, p, i32, p, p, i32]
    if lookup_name is not None:
        lookup = getattr(library, lookup_name)
        # packed weight, blocks per row, ids, number of ids, out
        lookup.restype, lookup.argtypes = None, [p, i32, p, i32, p]
    return library
