"""The only places tensors cross ranks inside a forward pass. Absent (never called) at tp=1."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def gather_to_first(x: torch.Tensor, tp_rank: int, tp_size: int, group) -> list[torch.Tensor] | None:
    """Every rank's x (same shape on all ranks) on rank 0; None elsewhere."""
    chunks = [torch.empty_like(x) for _ in range(tp_size)] if tp_rank == 0 else None
    dist.gather(x, gather_list=chunks, dst=0, group=group)
    return chunks
