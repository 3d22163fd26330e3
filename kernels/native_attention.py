"""Batch-invariant attention in one C call per layer: every row's reduction order fixed by the code.

kernels/native/attention.c computes each query row over its own lane's keys in key order, with
fixed partial sums, straight from the KV pool: no gathered copies of the keys, no padding to key
blocks, no mask. A row's bits depend on its query and its keys only, so a decode step, a Verify, a
chunk and a whole prefill agree, and so do tp=1 and tp=2 (a piece computes whole KV heads). On a
CPU it replaces the tiled BLAS products (kernels/tiled_attention.py), which stay for devices and
machines where no C kernel is built.
"""

from __future__ import annotations

import ctypes

import torch

from tpserve.kernels import native

PARTIAL_SUMS = 16  # attention.c's W: head_dim must be a multiple of it
MAX_GROUP = 64  # query heads per KV head attention.c's row block holds


class NativePlan:
    """One pass's spans as attention.c reads them: [num_spans, 4] int64 (offset, base, start, length)."""

    def __init__(self, spans, group: int):
        self.spans, self.group = spans, group
        self.num_rows = sum(s.length for s in spans)  # rows of q past these (padding) come out zero
        self.table = torch.tensor(
            [(s.offset, s.base, s.start, s.length) for s in spans], dtype=torch.int64
        ).view(-1, 4)


def native_unavailable(head_dim: int, group: int, dtype: torch.dtype, device) -> str | None:
    """None where the C kernel serves these shapes; else why not, in words."""
    if torch.device(device).type != "cpu":
        return f"the C attention kernel runs on CPUs, not on {torch.device(device).type}"
    if dtype != torch.float32:
        return f"the C attention kernel computes float32, not {dtype}"
    if head_dim % PARTIAL_SUMS or group > MAX_GROUP:
        return f"the C attention kernel needs head_dim a multiple of {PARTIAL_SUMS} and at most {MAX_GROUP} queries per KV head"
    try:
        _kernel()
    except native.NativeUnavailable as err:
        return str(err)
    return None


def _kernel():
    kernel = native.load("attention").tp_span_attention
    kernel.restype = ctypes.c_int
    kernel.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_void_p,
    ]
    return kernel


def native_attention(
    q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, plan: NativePlan, scale: float
) -> torch.Tensor:
    """q: [T, Hq, D] (rotated); pool_*: [Hkv, slots, D] already holding the spans' keys. Returns [T, Hq*D];
    rows no span holds (a pass's padding) are zeros."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = pool_k.shape[0]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if pool_k.stride(2) != 1 or pool_k.stride(1) != head_dim or pool_v.stride() != pool_k.stride():
        raise ValueError(
            "the KV pool's heads must be [slots, head_dim] rows with one layout for keys and values"
        )
    out = (torch.empty if plan.num_rows == num_tokens else torch.zeros)(num_tokens, num_heads, head_dim)
    failed = _kernel()(
        q.data_ptr(),
        q.stride(0),
        pool_k.data_ptr(),
        pool_v.data_ptr(),
        pool_k.stride(0),
        num_kv_heads,
        plan.group,
        head_dim,
        plan.table.data_ptr(),
        plan.table.shape[0],
        scale,
        out.data_ptr(),
    )
    if failed:
        raise MemoryError("the C attention kernel could not allocate its scores")
    return out.view(num_tokens, num_heads * head_dim)
