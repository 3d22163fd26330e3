"""Where a layer's pieces meet: the row-parallel sum and its all-reduce, and the head's logits gathered.

A rank holds one or more pieces of every layer (tpserve/ranks/sharding.py). A row-parallel product's
pieces each give a partial sum; they are added in piece order, in float32, then all-reduced across
ranks in rank order (tpserve/kernels/collectives.py), so tp=2 adds the same numbers in the same order
as tp=1. At tp=1 no collective is called.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.kernels.collectives import Collectives


def sum_partials(partials: Iterable[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """The pieces' partial sums [rows, hidden], added in piece order in float32 (zeros shaped like
    `rows` where no piece has any: a rank holding no KV head of a layer)."""
    total = None
    for out in partials:
        out = out if out.dtype == torch.float32 else out.float()
        total = out if total is None else total + out
    return torch.zeros(rows.shape, dtype=torch.float32, device=rows.device) if total is None else total


@dataclass(frozen=True)
class RankGroup:
    """This rank's place in the tensor-parallel group, and the model's dtype the reduced sums return in."""

    tp_rank: int
    tp_size: int
    collectives: Collectives | None
    dtype: torch.dtype

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """partial: [T, hidden] float32, already summed over this rank's pieces -> every rank's sum,
        in the model's dtype."""
        if self.tp_size > 1:
            self.collectives.all_reduce_sum(partial)
        return partial if partial.dtype == self.dtype else partial.to(self.dtype)

    def gather_logits(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """local: [n, V_rank], this rank's vocabulary columns; widths: every rank's V_rank. Returns
        float32 [n, vocab] on rank 0, None elsewhere: gathered in equal chunks (each padded to the
        widest), the padding cut off."""
        if self.tp_size == 1:
            return local.float()
        padded = F.pad(local, (0, max(widths) - local.shape[1]))
        chunks = self.collectives.gather_to_first(padded)
        if chunks is None:
            return None
        return torch.cat([chunk[:, :width] for chunk, width in zip(chunks, widths)], dim=-1).float()
