"""The only places tensors cross ranks inside a forward pass. Absent (never called) at tp=1.

Two implementations of the same two calls: `GroupCollectives` over a torch.distributed group (NCCL
between GPUs, gloo between hosts) and `SharedMemoryCollectives` (tpserve/kernels/shared_memory.py) between
CPU ranks on one host. Every rank calls them in the same order with same-shaped tensors.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Collectives(Protocol):
    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        """x becomes the sum of every rank's x, in place; returns x."""

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape on all ranks) on rank 0, in rank order; None elsewhere."""


class GroupCollectives:
    def __init__(self, group, rank: int, world_size: int):
        self.group, self.rank, self.world_size = group, rank, world_size

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        chunks = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, gather_list=chunks, dst=0, group=self.group)
        return chunks
