"""Decode rounds at padded stream counts, for CUDA graphs: a round of n streams runs at the smallest
bucket (1, 2, 4, 8, 16, 32, ...) that holds it, so a handful of captured graphs serve every count.

A graph replays fixed kernels on fixed memory, so a round's inputs go into static buffers
(`DecodeBuffers`: token ids, positions, KV slots and the paged kernel's CSR arrays, sized for the
bucket) and the padding rows must be harmless: each is a one-token span at position 0 of the
spare block, a block no stream holds, so it writes its KV only there and reads only its own key.
Every product is per row and attention per span, so no padding row can change a real row; the
padding rows' logits are dropped. `DecodeGraph` captures a step reading those buffers on CUDA and
runs it as it is elsewhere (the CPU tests run the same padded rounds eagerly).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpserve.kernels.attention import SpanView
from tpserve.kernels.paged_attention import PagedTables, paged_tables

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARMUP_STEPS = 2  # eager runs before capture: lazy initialisation (cuBLAS handles, workspaces)


def bucket_for(num_streams: int, largest: int = DECODE_BUCKETS[-1]) -> int | None:
    """The smallest bucket holding num_streams rows, None past `largest` (such a round runs eager)."""
    if num_streams < 1:
        raise ValueError(f"a decode round has at least one stream, not {num_streams}")
    return next((b for b in DECODE_BUCKETS if num_streams <= b <= largest), None)


def padded_round(
    spans: list[SpanView], token_ids: list[int], positions: list[int], bucket: int, spare_block: int
) -> tuple[list[SpanView], list[int], list[int]]:
    """A decode round's one-row spans (their tokens and positions) padded to `bucket` rows: padding
    row j is token 0 at position 0 of `spare_block`, a block no span's table may hold."""
    if any(span.length != 1 for span in spans) or len(spans) > bucket:
        raise ValueError(f"{len(spans)} spans are not a decode round of at most {bucket} one-row spans")
    if any(spare_block in span.blocks for span in spans):
        raise ValueError(f"block {spare_block} is a stream's, not spare")
    padding = [SpanView(len(spans) + j, 0, 1, (spare_block,)) for j in range(bucket - len(spans))]
    num_pad = len(padding)
    return [*spans, *padding], [*token_ids, *[0] * num_pad], [*positions, *[0] * num_pad]


class DecodeBuffers:
    """A bucket's static inputs on the device: graphs read these, never tensors made per round.
    max_pages: the most KV pages the bucket's streams hold together."""

    def __init__(self, bucket: int, max_pages: int, block_size: int, device):
        self.bucket, self.block_size = bucket, block_size
        zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        self.token_ids, self.positions, self.slots = zeros(bucket), zeros(bucket), zeros(bucket)
        ints = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
        self.kv_indptr, self.kv_indices, self.kv_last_page_len = (
            ints(bucket + 1),
            ints(max_pages),
            ints(bucket),
        )

    def fill(
        self, spans: list[SpanView], token_ids: list[int], positions: list[int], num_slots: int
    ) -> PagedTables:
        """Copy a padded round (padded_round) into the buffers, in place; its CSR arrays on the host."""
        if len(spans) != self.bucket:
            raise ValueError(f"a round of {len(spans)} rows for a bucket of {self.bucket}")
        tables = paged_tables(spans, self.block_size, num_slots)
        if tables.kv_indices.numel() > self.kv_indices.numel():
            raise ValueError(f"{tables.kv_indices.numel()} pages past the buffers' {self.kv_indices.numel()}")
        size = self.block_size
        slots = [span.blocks[p // size] * size + p % size for span, p in zip(spans, positions)]
        for buffer, values in (
            (self.token_ids, torch.tensor(token_ids)),
            (self.positions, torch.tensor(positions)),
            (self.slots, torch.tensor(slots)),
            (self.kv_indptr, tables.kv_indptr),
            (self.kv_last_page_len, tables.kv_last_page_len),
        ):
            buffer.copy_(values, non_blocking=True)
        self.kv_indices[: tables.kv_indices.numel()].copy_(tables.kv_indices, non_blocking=True)
        return tables


class DecodeGraph:
    """`step` (reading only static buffers, returning its output tensor) captured as a CUDA graph on
    a GPU, replayed by run(); elsewhere run() calls it."""

    def __init__(self, step: Callable[[], torch.Tensor], device, pool=None):
        """pool: the memory pool graphs share (torch.cuda.graph_pool_handle), or None for its own."""
        self.step, self.graph, self.output = step, None, None
        if torch.device(device).type != "cuda":
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = step()

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self.step()
        self.graph.replay()
        return self.output
