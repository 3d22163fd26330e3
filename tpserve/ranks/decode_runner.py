"""Decode rounds through CUDA graphs: the engine's decode round, on a GPU serving FlashInfer, run
as the replay of its bucket's graph (tpserve/ranks/decode_graphs.py: buckets, padding, static buffers).

A round of n streams is padded to its bucket, written into the bucket's buffers, FlashInfer's decode
wrapper is planned for the round's tables on the host (outside the graph), and the graph replays:
every kernel of the pass (embedding, each layer's products, KV writes, attention, the all-reduces
where torch captures NCCL, the head) in one launch. A bucket's graph is captured the first time a
round takes it; every rank sees the same rounds, so every rank captures at the same round and its
collectives pair up. Off a GPU the same round runs eagerly, which is what the CPU tests check.

Graphs need a pass whose every kernel reads fixed memory and fixed shapes: FlashInfer's paged
decode (SDPA a span at a time loops over the round's spans in Python), no sliding window nor sinks
(those layers run SDPA), no experts (their routing picks rows at run time), a 1-D rotary, and a
model group torch can capture (NCCL, or none at tp=1). `graphs_unfit` says which is missing.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpserve.kernels.attention import SpanView
from tpserve.kernels.collectives import GroupCollectives
from tpserve.kernels.paged_attention import FlashInfer, PagedTables
from tpserve.ranks.decode_graphs import DECODE_BUCKETS, DecodeBuffers, DecodeGraph, bucket_for, padded_round
from tpserve.ranks.mrope import MRotary


def graphs_unfit(
    device_type: str,
    attention: str,
    *,
    windows: bool,
    sinks: bool,
    experts: bool,
    multimodal: bool,
    tp_size: int,
    group_backend: str | None,
) -> str | None:
    """None where decode rounds can replay as CUDA graphs; else why not, in words.
    attention: the kernel's name (tpserve/kernels/attention_kernels.py: "paged" is FlashInfer's);
    group_backend: the model group's torch.distributed backend (None at tp=1)."""
    if device_type != "cuda":
        return f"CUDA graphs run on a GPU, not on {device_type}"
    if attention != "paged":
        return f"attention {attention} loops over the round's streams; graphs need FlashInfer's paged kernel"
    if windows or sinks:
        return "sliding-window or sink layers run SDPA a stream at a time"
    if experts:
        return "experts route rows at run time"
    if multimodal:
        return "a multimodal rotary's positions are three rows"
    if tp_size > 1 and group_backend != "nccl":
        return f"the model group's collectives ({group_backend}) are not captured in a graph"
    return None


def model_graphs_unfit(model, tp_size: int) -> str | None:
    """graphs_unfit for a loaded rank model (its device, kernel, layers and model group)."""
    config, collectives = model.config, model.collectives
    group = collectives.group if tp_size > 1 and isinstance(collectives, GroupCollectives) else None
    return graphs_unfit(
        model.device.type,
        model.attention.name,
        windows=bool(config.windows and any(config.windows)),
        sinks=bool(config.sinks),
        experts=config.moe is not None,
        multimodal=isinstance(model.rotary, MRotary),
        tp_size=tp_size,
        group_backend=dist.get_backend(group) if group is not None else "none of torch's",
    )


class RoundPaged:
    """A graphed round's attention plan, read by tpserve/kernels/paged_attention.py as a PagedPlan is: the
    bucket's CSR buffers, planned afresh each round (prepare) before the replay."""

    def __init__(self, buffers: DecodeBuffers, backend: FlashInfer | None, head_shapes, scale, dtypes):
        self.block_size, self.num_tokens, self.decode = buffers.block_size, buffers.bucket, True
        self.backend, self.scale, self.dtypes = backend, scale, dtypes  # dtypes: (q's, the pool's)
        self.spans: list[SpanView] = []
        self.tables: PagedTables | None = None
        # per head shape (Hq, Hkv, D): one graph wrapper reading the bucket's buffers
        self._wrappers = {}
        if backend is not None:
            arrays = (buffers.kv_indptr, buffers.kv_indices, buffers.kv_last_page_len)
            for shape in head_shapes:
                self._wrappers[shape] = backend.graph_decode_wrapper(*arrays, shape[0], shape[1])

    def prepare(self, spans: list[SpanView], tables: PagedTables) -> None:
        """This round's spans and host tables; FlashInfer's wrappers planned for them."""
        self.spans, self.tables = spans, tables
        for shape, wrapper in self._wrappers.items():
            FlashInfer.plan_round(wrapper, tables, shape, self.scale, *self.dtypes)

    def wrapper(self, q: torch.Tensor, pool: torch.Tensor, scale: float):
        if self.backend is None:
            return None
        return self._wrappers[(q.shape[1], pool.shape[0], q.shape[2])]

    def span_plan(self):
        raise RuntimeError("a graphed decode round has no windowed or sink layer (graphs_unfit)")


class RoundPlan:
    """tpserve/ranks/model.py's PassPlan for a graphed round: slots and positions from the bucket's buffers,
    the rotary tables computed inside the graph; rows padded to whole tiles where the model pads."""

    def __init__(self, model, buffers: DecodeBuffers, attention: RoundPaged):
        tile = model.pad_rows
        self.num_tokens = buffers.bucket
        self.num_rows = -(-buffers.bucket // tile) * tile if tile else buffers.bucket
        self.padding = self.num_rows - self.num_tokens
        self.slots, self.attention, self.local_rotary = buffers.slots, attention, None
        self.kernel = model.attention
        self.rotary = None  # (cos, sin), set by the step from buffers.positions

    @property
    def spans(self) -> list[SpanView]:
        return self.attention.spans


class DecodeGraphs:
    """A model's graphed decode rounds: per bucket its buffers, plan and graph, built on first use.
    spare_block: a KV block no lane holds (the engine keeps it out of every table)."""

    def __init__(self, model, kv, spare_block: int, largest: int = DECODE_BUCKETS[-1]):
        self.model, self.kv, self.spare_block, self.largest = model, kv, spare_block, largest
        self._rounds: dict[int, tuple[DecodeBuffers, RoundPlan]] = {}
        self._graphs: dict[int, DecodeGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if model.device.type == "cuda" else None

    def takes(self, num_streams: int) -> bool:
        """Whether a round of num_streams replays a graph (past the largest bucket it runs eagerly)."""
        return bucket_for(num_streams, self.largest) is not None

    def run(self, spans: list[SpanView], token_ids: list[int], positions: list[int]) -> torch.Tensor | None:
        """The round's logits [len(spans), vocab] float32 on rank 0, None elsewhere (takes() first)."""
        bucket = bucket_for(len(spans), self.largest)
        padded = padded_round(spans, token_ids, positions, bucket, self.spare_block)
        if bucket not in self._rounds:
            self._rounds[bucket] = self._made(bucket)
        buffers, plan = self._rounds[bucket]
        plan.attention.prepare(padded[0], buffers.fill(*padded, self.kv.num_slots))
        graph = self._graphs.get(bucket)
        if graph is None:  # captured now, planned for this round: its replay below is this round
            step = functools.partial(self._step, buffers, plan)
            graph = self._graphs[bucket] = DecodeGraph(step, self.model.device, self._pool)
        logits = graph.run()
        return None if logits is None else logits[: len(spans)]

    def _made(self, bucket: int) -> tuple[DecodeBuffers, RoundPlan]:
        model, head_dim = self.model, self.model.config.head_dim
        buffers = DecodeBuffers(bucket, self.kv.num_blocks + bucket, self.kv.block_size, model.device)
        first = model.layers[0].self_attn
        shapes = {
            (piece.num_q_heads, piece.num_kv_heads, head_dim) for piece in first.pieces if piece.num_kv_heads
        }
        dtypes = (model.dtype, self.kv.k[0].dtype)
        attention = RoundPaged(buffers, model.attention.backend, sorted(shapes), first.scale, dtypes)
        return buffers, RoundPlan(model, buffers, attention)

    def _step(self, buffers: DecodeBuffers, plan: RoundPlan) -> torch.Tensor | None:
        """The round as the graph records it: reads only the buffers (and the pool)."""
        model = self.model
        positions = F.pad(buffers.positions, (0, plan.padding)) if plan.padding else buffers.positions
        plan.rotary = model.rotary.tables(positions, model.dtype)
        with torch.inference_mode():
            return model.forward_planned(buffers.token_ids, plan, self.kv, slice(0, buffers.bucket))
