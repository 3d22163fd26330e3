"""Attention on a GPU by FlashInfer's paged kernels, reading the pool through the block tables: one
call per layer for every span of a pass (decode rows, Verify rows and prompt chunks alike).

A layer's pool [Hkv, num_blocks * block_size, D] seen as .view(Hkv, num_blocks, block_size, D)
.transpose(0, 1) is FlashInfer's "HND" paged layout [num_pages, Hkv, page_size, D] (a strided view:
pages block_size * D apart, heads num_slots * D). The tables go as CSR (`PagedTables`): span i's
pages are kv_indices[kv_indptr[i] : kv_indptr[i + 1]], its last page holds kv_last_page_len[i]
keys, and its query rows are qo_indptr[i] .. qo_indptr[i + 1] - 1. A pass whose spans are all one
row runs the decode wrapper (BatchDecodeWithPagedKVCacheWrapper), any other the prefill wrapper
(BatchPrefillWithPagedKVCacheWrapper, causal: FlashInfer aligns a span's mask to its last key, so a
chunk's row i sees keys 0 .. start + i). Each wrapper is planned once per pass and head shape, and
run by every layer.

The fallback order: FlashInfer where it imports and the pass is float16 or bfloat16 with no sinks,
no window that binds and no image whose rows see each other (Gemma 3's); else SDPA a span at a
time, its keys gathered through the same CSR arrays
(what this module's CPU tests run, and what a GPU without FlashInfer serves through
tpserve/kernels/attention.py's spans kernel). FlashInfer is optional: nothing here imports it until a GPU
pass asks, and a machine without it serves SDPA.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.kernels.attention import BlockTables, SpanPlan, SpanView, causal, span_attention

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's float workspace: the size its examples allocate
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PagedTables:
    """A pass's block tables as FlashInfer's CSR arrays, int32 on the CPU."""

    qo_indptr: torch.Tensor  # [S + 1]: span i's rows are qo_indptr[i] .. qo_indptr[i + 1] - 1
    kv_indptr: torch.Tensor  # [S + 1]: span i's pages are kv_indices[kv_indptr[i] : kv_indptr[i + 1]]
    kv_indices: torch.Tensor  # [pages]: every span's table, cut to its keys, concatenated
    kv_last_page_len: torch.Tensor  # [S]: keys in a span's last page, 1 .. block_size
    block_size: int

    def to(self, device) -> PagedTables:
        moved = (
            t.to(device) for t in (self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len)
        )
        return PagedTables(*moved, self.block_size)


def paged_tables(spans: list[SpanView], block_size: int, num_slots: int) -> PagedTables:
    """The CSR arrays of `spans` (their tables checked against a pool of num_slots slots)."""
    tables = BlockTables(spans, block_size, num_slots)  # refuses a block outside the pool
    pages = [-(-span.end // block_size) for span in spans]
    kv_indptr = torch.tensor([0, *pages], dtype=torch.int64).cumsum(0)
    qo_indptr = torch.tensor([0, *(span.length for span in spans)], dtype=torch.int64).cumsum(0)
    last = [span.end - (count - 1) * block_size for span, count in zip(spans, pages)]
    return PagedTables(
        qo_indptr.to(torch.int32),
        kv_indptr.to(torch.int32),
        tables.flat.to(torch.int32),
        torch.tensor(last, dtype=torch.int32),
        block_size,
    )


def pages_of(pool: torch.Tensor, block_size: int) -> torch.Tensor:
    """pool [Hkv, slots, D] -> its HND pages [num_blocks, Hkv, block_size, D] (a view, no copy)."""
    num_kv_heads, num_slots, head_dim = pool.shape
    return pool.view(num_kv_heads, num_slots // block_size, block_size, head_dim).transpose(0, 1)


def gather_keys(pool: torch.Tensor, tables: PagedTables, span: int) -> torch.Tensor:
    """Span `span`'s keys 0..end-1 [Hkv, end, D], read page by page as the CSR arrays name them."""
    first, stop = int(tables.kv_indptr[span]), int(tables.kv_indptr[span + 1])
    ids = tables.kv_indices[first:stop].to(device=pool.device, dtype=torch.int64)
    pages = pages_of(pool, tables.block_size).index_select(0, ids)  # [n, Hkv, block_size, D]
    keys = pages.transpose(0, 1).reshape(pool.shape[0], -1, pool.shape[2])  # [Hkv, n * block_size, D]
    end = (stop - first - 1) * tables.block_size + int(tables.kv_last_page_len[span])
    return keys[:, :end]


def flashinfer_installed() -> bool:
    """Whether FlashInfer can be imported here (found, not imported)."""
    return importlib.util.find_spec("flashinfer") is not None


def flashinfer_module():
    """FlashInfer, or None where it is not installed (an optional package: imported on first use)."""
    return importlib.import_module("flashinfer") if flashinfer_installed() else None


class FlashInfer:
    """One device's FlashInfer: its workspace (allocated at the first pass) and the wrappers."""

    def __init__(self, module, device):
        self.module, self.device = module, torch.device(device)
        self._workspace: torch.Tensor | None = None

    def workspace(self) -> torch.Tensor:
        """The float workspace every wrapper of this device shares (one stream runs them in turn)."""
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return self._workspace

    def planned(self, tables: PagedTables, decode: bool, q, pool, scale: float):
        """A wrapper planned for this pass's tables and this head shape (q [T, Hq, D], pool [Hkv, slots, D])."""
        num_q, num_kv, head_dim = q.shape[1], pool.shape[0], q.shape[2]
        common = {"sm_scale": scale, "q_data_type": q.dtype, "kv_data_type": pool.dtype}
        if decode:
            wrapper = self.module.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace(), "HND", use_tensor_cores=num_q // num_kv >= 4
            )
            wrapper.plan(
                tables.kv_indptr, tables.kv_indices, tables.kv_last_page_len,
                num_q, num_kv, head_dim, tables.block_size, **common,
            )  # fmt: skip
        else:
            wrapper = self.module.BatchPrefillWithPagedKVCacheWrapper(self.workspace(), "HND")
            wrapper.plan(
                tables.qo_indptr, tables.kv_indptr, tables.kv_indices, tables.kv_last_page_len,
                num_q, num_kv, head_dim, tables.block_size, causal=True, **common,
            )  # fmt: skip
        return wrapper

    def graph_decode_wrapper(self, indptr, indices, last_page_len, num_q: int, num_kv: int):
        """A decode wrapper for CUDA graphs: its kernel reads the CSR arrays from these fixed device
        buffers (a bucket's: tpserve/ranks/decode_graphs.py), which plan_round fills before each replay."""
        return self.module.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace(), "HND", use_cuda_graph=True, use_tensor_cores=num_q // num_kv >= 4,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len,
        )  # fmt: skip

    @staticmethod
    def plan_round(wrapper, tables: PagedTables, head_shape, scale: float, q_dtype, kv_dtype) -> None:
        """Plan a graph's decode wrapper for this round's tables (host arrays), outside the graph."""
        num_q, num_kv, head_dim = head_shape
        wrapper.plan(
            tables.kv_indptr, tables.kv_indices, tables.kv_last_page_len, num_q, num_kv, head_dim,
            tables.block_size, sm_scale=scale, q_data_type=q_dtype, kv_data_type=kv_dtype,
        )  # fmt: skip


class PagedPlan:
    """What every layer of a pass reads: the CSR tables (on the CPU: FlashInfer's plan reads them
    there and copies them to the device itself, so no plan waits on the device), and per head shape
    the planned wrapper; SpanPlan for the layers FlashInfer does not
    take (a binding window, sinks), built on first need."""

    def __init__(self, spans, num_slots: int, block_size: int, device, backend: FlashInfer | None = None):
        self.spans, self.num_slots, self.block_size, self.device = spans, num_slots, block_size, device
        self.tables = paged_tables(spans, block_size, num_slots)
        self.num_tokens = int(self.tables.qo_indptr[-1])
        self.decode = all(span.length == 1 for span in spans)
        self.backend = backend
        self._wrappers: dict = {}
        self._span_plan: SpanPlan | None = None

    def wrapper(self, q: torch.Tensor, pool: torch.Tensor, scale: float):
        """The planned FlashInfer wrapper for this head shape, or None where it does not serve."""
        if self.backend is None or q.dtype not in FLASHINFER_DTYPES or pool.dtype != q.dtype:
            return None
        key = (q.shape[1], pool.shape[0], q.shape[2], q.dtype, scale)
        if key not in self._wrappers:
            self._wrappers[key] = self.backend.planned(self.tables, self.decode, q, pool, scale)
        return self._wrappers[key]

    def span_plan(self) -> SpanPlan:
        if self._span_plan is None:
            self._span_plan = SpanPlan(self.spans, self.num_slots, self.block_size, self.device)
        return self._span_plan


def paged_attention(
    q: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    plan: PagedPlan,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [rows, Hq, D] (rotated; rows past the spans' tokens are padding, left zero); pool_*: [Hkv,
    slots, D] holding the spans' keys. Returns [rows, Hq*D], as span_attention."""
    # (FlashInfer's causal mask knows no images: a pass holding one runs SDPA's masks)
    binding = window and any(span.end > window for span in plan.spans)
    if sinks is not None or binding or any(span.images for span in plan.spans):
        return span_attention(q, pool_k, pool_v, plan.span_plan(), scale, window, sinks)
    num_rows, num_heads, head_dim = q.shape
    real = q[: plan.num_tokens]
    wrapper = plan.wrapper(q, pool_k, scale)
    if wrapper is not None:
        pages = (pages_of(pool_k, plan.block_size), pages_of(pool_v, plan.block_size))
        out = wrapper.run(real.contiguous(), pages)  # [T, Hq, D]
    else:
        out = _sdpa_through_pages(real, pool_k, pool_v, plan, scale)
    if num_rows > plan.num_tokens:
        out = F.pad(out, (0, 0, 0, 0, 0, num_rows - plan.num_tokens))
    return out.reshape(num_rows, num_heads * head_dim)


def _sdpa_through_pages(q, pool_k, pool_v, plan: PagedPlan, scale: float) -> torch.Tensor:
    """The fallback: SDPA a span at a time over its keys gathered through the CSR arrays."""
    out = torch.empty_like(q)
    for index, span in enumerate(plan.spans):
        rows = slice(span.offset, span.offset + span.length)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        ks = gather_keys(pool_k, plan.tables, index).unsqueeze(0).to(q.dtype)  # [1, Hkv, end, D]
        vs = gather_keys(pool_v, plan.tables, index).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True, **causal(span))
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
