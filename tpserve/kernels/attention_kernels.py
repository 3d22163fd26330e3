"""Which attention kernel a model serves with, chosen once at load.

- native: tpserve/kernels/native_attention.py, one C call per layer, batch-invariant; CPUs, float32, where
  a C compiler builds it.
- tiled: tpserve/kernels/tiled_attention.py, fixed-shape BLAS products, batch-invariant on any device.
- paged: tpserve/kernels/paged_attention.py, FlashInfer's paged kernels through the block tables, one call
  per layer for every span; GPUs where FlashInfer is installed, float16 or bfloat16, not
  batch-invariant.
- spans: tpserve/kernels/attention.py, SDPA a span at a time: fast, not batch-invariant; the fallback.
Without batch invariance the order is FALLBACK_ORDER, FlashInfer then SDPA (attention_choice, the
one place that decides). Every rank of a group must serve with the same one: the choice is a column
of the flags row (tpserve/ranks/flags.py), agreed before loading, and native vs tiled is agreed after it
(tpserve/ranks/startup.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpserve.kernels.attention import SpanPlan, span_attention
from tpserve.kernels.native_attention import (
    NativePlan,
    native_attention,
    native_unavailable,
    rotate_store_attend,
)
from tpserve.kernels.paged_attention import (
    FLASHINFER_DTYPES,
    FlashInfer,
    PagedPlan,
    flashinfer_installed,
    flashinfer_module,
    paged_attention,
)
from tpserve.kernels.tiled_attention import TiledPlan, tiled_attention

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionKernel:
    name: str
    # (spans, group, num_slots, block_size, device, num_rows) -> what `attend` reads, the spans' keys
    # through their block tables (tpserve/kernels/attention.py): built once per pass
    plan: Callable
    # (q [T, Hq, D], pool_k, pool_v [Hkv, slots, D], plan, scale, window=0, sinks=None) -> [T, Hq*D]:
    # window the layer's sliding window (0: none), sinks its [Hq] sink logits (None: none)
    attend: Callable
    # (qkv [T, (Hq + 2 Hkv) * D] unrotated, num_q, normed q and k or None, rotary tables, slots,
    # pool_k, pool_v, plan, scale, window=0, sinks=None) -> [T, Hq*D]: rotary, the KV writes and
    # attend in one call, where the kernel has one (tpserve/kernels/native_attention.py)
    rotate_store_attend: Callable | None = None
    backend: FlashInfer | None = None  # the paged kernel's FlashInfer (None: its SDPA fallback)


NATIVE = AttentionKernel(
    "native",
    lambda spans, group, num_slots, block_size, *_: NativePlan(spans, group, num_slots, block_size),
    native_attention,
    rotate_store_attend=rotate_store_attend,
)
TILED = AttentionKernel("tiled", TiledPlan, tiled_attention)
SPANS = AttentionKernel(
    "spans",
    lambda spans, group, num_slots, block_size, device, *_: SpanPlan(spans, num_slots, block_size, device),
    span_attention,
)


def paged_kernel(backend: FlashInfer | None) -> AttentionKernel:
    """The paged kernel on `backend` (None: its SDPA fallback through the same tables)."""

    def plan(spans, group, num_slots, block_size, device, *_):
        return PagedPlan(spans, num_slots, block_size, device, backend)

    return AttentionKernel("paged" if backend else "paged-sdpa", plan, paged_attention, backend=backend)


FALLBACK_ORDER = ("flashinfer", "sdpa")  # without batch invariance: the first that serves here
ATTENTION_CHOICES = ("invariant", *FALLBACK_ORDER)  # the flags row's names (invariant: native or tiled)


def attention_choice(
    batch_invariant: bool, dtype: torch.dtype, device_type: str, has_flashinfer: bool
) -> str:
    """Which kernel family a rank serves with, before anything loads: "invariant" (native or tiled,
    settled after loading), else the first of FALLBACK_ORDER this rank can run: FlashInfer on CUDA
    in float16 or bfloat16 where it is installed, else SDPA."""
    if batch_invariant:
        return "invariant"
    if device_type == "cuda" and has_flashinfer and dtype in FLASHINFER_DTYPES:
        return "flashinfer"
    return "sdpa"


def rank_attention_choice(batch_invariant: bool, dtype: torch.dtype, device) -> str:
    """attention_choice for this process (whether FlashInfer is installed here)."""
    kind = torch.device(device).type
    return attention_choice(batch_invariant, dtype, kind, kind == "cuda" and flashinfer_installed())


def choose_attention(
    batch_invariant: bool, head_dim: int, group: int, dtype: torch.dtype, device
) -> AttentionKernel:
    """The fastest kernel that keeps the exactness asked for on this device."""
    choice = rank_attention_choice(batch_invariant, dtype, device)
    if choice == "flashinfer":
        return paged_kernel(FlashInfer(flashinfer_module(), device))
    if choice == "sdpa":
        return SPANS
    why_not = native_unavailable(head_dim, group, dtype, device)
    if why_not is None:
        return NATIVE
    log.info("attention: tiled BLAS products (%s)", why_not)
    return TILED


def kv_dtype(choice: str, attention: AttentionKernel, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's type for `choice` ("auto" or a dtype's name): auto is float16 where the C kernel
    reads the pool beside float32 weights (it widens each key and value exactly, so only the store
    rounds: half the bytes a decode step reads and twice the tokens in the same memory), else the
    weights' own dtype."""
    if choice != "auto":
        return getattr(torch, choice)
    return torch.float16 if attention is NATIVE and dtype == torch.float32 else dtype
