"""Batch-invariant attention in one C call per layer: every row's reduction order fixed by the code.

tpserve/kernels/native/attention.c computes each query row over its own stream's keys in key order, with
fixed partial sums, straight from the KV pool through the span's block table (tpserve/kernels/attention.py):
no gathered copies of the keys, no padding to key blocks, no mask. A row's bits depend on its query and its keys only, so a decode step, a Verify, a
chunk and a whole prefill agree, and so do tp=1 and tp=2 (a piece computes whole KV heads). On a
CPU it replaces the tiled BLAS products (tpserve/kernels/tiled_attention.py), which stay for devices and
machines where no C kernel is built.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tpserve.kernels import native
from tpserve.kernels.attention import BlockTables

PARTIAL_SUMS = 16  # attention.c's W: head_dim must be a multiple of it
MAX_GROUP = 64  # query heads per KV head attention.c's row block holds
MAX_HEAD_DIM = 512  # the rotated key row tp_rotate_store_attend holds


class NativePlan:
    """One pass's spans as attention.c reads them: `table` [num_spans, 4] int64 (offset, where the
    span's block table begins in `blocks`, start, length) and `blocks`, the tables concatenated;
    where a span holds images whose rows see each other (SpanView.images), `image_index` [num_spans
    + 1] and `image_ranges` [images, 2] (first, end) (span s's are rows image_index[s] ..
    image_index[s + 1] - 1), else both None."""

    def __init__(self, spans, group: int, num_slots: int, block_size: int):
        # (the tables tensor lives as long as the plan: the C kernel reads its memory)
        self.spans, self.group, self.num_slots, self.block_size = spans, group, num_slots, block_size
        self.num_rows = sum(s.length for s in spans)  # rows of q past these (padding) come out zero
        tables = BlockTables(spans, block_size, num_slots)
        rows = [(span.offset, first, span.start, span.length) for span, first in zip(spans, tables.first)]
        self.table = torch.tensor(rows, dtype=torch.int64).view(-1, 4)
        self.blocks = tables.flat
        self.image_index = self.image_ranges = None
        if any(span.images for span in spans):
            counts = [len(span.images) for span in spans]
            self.image_index = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
            ranges = [bounds for span in spans for bounds in span.images]
            self.image_ranges = torch.tensor(ranges, dtype=torch.int64).view(-1, 2)


def native_unavailable(head_dim: int, group: int, dtype: torch.dtype, device) -> str | None:
    """None where the C kernel serves these shapes; else why not, in words."""
    if torch.device(device).type != "cpu":
        return f"the C attention kernel runs on CPUs, not on {torch.device(device).type}"
    if dtype != torch.float32:
        return f"the C attention kernel computes float32, not {dtype}"
    if head_dim % PARTIAL_SUMS or head_dim > MAX_HEAD_DIM or group > MAX_GROUP:
        return (
            f"the C attention kernel needs head_dim a multiple of {PARTIAL_SUMS} up to {MAX_HEAD_DIM} and "
            f"at most {MAX_GROUP} queries per KV head"
        )
    try:
        _kernel()
    except native.NativeUnavailable as err:
        return str(err)
    return None


_P, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# The tail every entry point shares: pool_k, pool_v, head_stride, kv_half, num_kv_heads, group,
# head_dim, spans, num_spans, blocks, block_size, window, sinks, image_index, image_ranges, scale, out.
_ATTEND = [_P, _P, _I64, _INT, _INT, _INT, _INT, _P, _INT, _P, _I64, _I64, _P, _P, _P, _FLOAT, _P]
POOL_DTYPES = (torch.float32, torch.float16)  # what the KV pool may hold: float16 is widened exactly
_SIGNATURES = {
    "tp_span_attention": [_P, _I64, *_ATTEND],
    # q, k, v with their token strides, cos, sin, slots, num_real, then the shared tail
    "tp_rotate_store_attend": [_P, _I64, _P, _I64, _P, _I64, _P, _P, _P, _I64, *_ATTEND],
    "tp_attention_path": [_INT],
    "tp_attention_paths": [],
}


@functools.cache
def _entry(name: str):
    entry = getattr(native.load("attention"), name)
    entry.restype, entry.argtypes = ctypes.c_int, _SIGNATURES[name]
    return entry


def _kernel():
    return _entry("tp_span_attention")


ATTENTION_PATHS = ("plain", "avx2", "avx512")  # attention.c's PATH_*: the same bits on each


def attention_paths() -> list[str]:
    """The paths of attention.c this CPU runs."""
    paths = _entry("tp_attention_paths")()
    return [name for bit, name in enumerate(ATTENTION_PATHS) if paths & (1 << bit)]


def use_attention_path(name: str | None) -> None:
    """Run attention.c's `name` path from now on (None: the fastest here, the default). For tests and
    benches: every path gives the same bits."""
    if _entry("tp_attention_path")(-1 if name is None else ATTENTION_PATHS.index(name)) < 0:
        raise ValueError(f"attention path {name!r} does not run on this CPU; it runs {attention_paths()}")


def native_attention(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    plan: NativePlan,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] (rotated); pool_*: [Hkv, slots, D] already holding the spans' keys. Returns [T, Hq*D];
    rows no span holds (a pass's padding) are zeros. window: a row at position p sees keys p - window
    + 1 .. p (0: all of 0 .. p); sinks: [Hq] float32 logits in each row's softmax denominator, or None."""
    num_tokens, num_heads, head_dim = q.shape
    q = _rows_of_heads(q)
    _check_pool(pool_k, pool_v, plan)
    out = (torch.empty if plan.num_rows == num_tokens else torch.zeros)(num_tokens, num_heads, head_dim)
    sinks = _sinks(sinks, num_heads)  # (held here while the kernel reads it)
    args = _attend_args(pool_k, pool_v, plan, head_dim, window, sinks, scale, out)
    failed = _kernel()(q.data_ptr(), q.stride(0), *args)
    _check(failed)
    return out.view(num_tokens, num_heads * head_dim)


def rotate_store_attend(
    qkv,
    num_q: int,
    normed,
    tables,
    slots,
    pool_k,
    pool_v,
    plan: NativePlan,
    scale: float,
    window=0,
    sinks=None,
) -> torch.Tensor:
    """A layer's attention block in one call: q and k rotated by `tables` (cos, signed sin: [T, 1,
    D]), k and v stored at `slots` ([T_real], kv_slots: rows past them are padding), then attention.

    qkv: [T, (Hq + 2 Hkv) * D], the fused product (q heads, k heads, v heads); normed: None, or q
    [T, Hq, D] and k [T, Hkv, D] normed first (qk_norm), read instead of qkv's; pool_*: [Hkv,
    slots, D]; window, sinks: as native_attention reads them. Returns [T, Hq*D], padding rows zero."""
    _check_pool(pool_k, pool_v, plan)
    num_kv_heads, head_dim = pool_k.shape[0], pool_k.shape[2]
    num_tokens = qkv.shape[0]
    if qkv.stride(1) != 1:
        raise ValueError("qkv must be rows of whole heads")
    float_size = qkv.element_size()
    base, stride = qkv.data_ptr(), qkv.stride(0)
    q, q_stride = base, stride
    k, k_stride = base + num_q * head_dim * float_size, stride
    v = base + (num_q + num_kv_heads) * head_dim * float_size
    if normed is not None:
        (q, q_stride), (k, k_stride) = ((x.data_ptr(), x.stride(0)) for x in map(_rows_of_heads, normed))
    cos, sin = tables
    sinks = _sinks(sinks, num_q)  # (held here while the kernel reads it)
    out = (torch.empty if plan.num_rows == num_tokens else torch.zeros)(num_tokens, num_q * head_dim)
    failed = _entry("tp_rotate_store_attend")(
        q,
        q_stride,
        k,
        k_stride,
        v,
        stride,
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        slots.shape[0],
        *_attend_args(pool_k, pool_v, plan, head_dim, window, sinks, scale, out),
    )
    _check(failed)
    return out


def _rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with whole heads in rows (copied if not)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """A layer's sink logits as the kernel reads them: [num_heads] contiguous float32."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} for {num_heads} query heads")
    return sinks.float().contiguous()


def _attend_args(
    pool_k, pool_v, plan: NativePlan, head_dim: int, window: int, sinks, scale: float, out
) -> tuple:
    num_kv_heads = pool_k.shape[0]
    return (
        pool_k.data_ptr(),
        pool_v.data_ptr(),
        pool_k.stride(0),
        int(pool_k.dtype == torch.float16),
        num_kv_heads,
        plan.group,
        head_dim,
        plan.table.data_ptr(),
        plan.table.shape[0],
        plan.blocks.data_ptr(),
        plan.block_size,
        int(window or 0),
        None if sinks is None else sinks.data_ptr(),
        None if plan.image_index is None else plan.image_index.data_ptr(),
        None if plan.image_ranges is None else plan.image_ranges.data_ptr(),
        scale,
        out.data_ptr(),
    )


def _check_pool(pool_k, pool_v, plan: NativePlan) -> None:
    head_dim = pool_k.shape[2]
    if pool_k.shape[1] < plan.num_slots:  # the plan's tables were checked against num_slots
        raise ValueError(f"a pool of {pool_k.shape[1]} slots under a plan for {plan.num_slots}")
    if pool_k.stride(2) != 1 or pool_k.stride(1) != head_dim or pool_v.stride() != pool_k.stride():
        raise ValueError(
            "the KV pool's heads must be [slots, head_dim] rows with one layout for keys and values"
        )
    if pool_k.dtype not in POOL_DTYPES or pool_v.dtype != pool_k.dtype:
        raise ValueError(f"the C attention kernel reads a float32 or float16 KV pool, not {pool_k.dtype}")


def _check(failed: int) -> None:
    if failed:
        raise MemoryError("the C attention kernel could not allocate its scores")
