"""Image features in place of token embeddings, in a way that keeps tp=1 and tp=2 identical.

Every rank zeroes the image rows of its embedding partial sum; rank 0 alone adds the features. The
all-reduce that follows then gives every rank exactly the features (f + 0.0 is f, in any rank
order), and at tp=1 the one rank computes the same 0.0 + f. The followers never see the features.
"""

from __future__ import annotations

import torch


def place_features(partial: torch.Tensor, rows: torch.Tensor, features: torch.Tensor | None) -> None:
    """partial: [T, hidden] float32, this rank's embedding sum; rows: [M] row indices; features:
    [M, hidden] on rank 0, None on the other ranks."""
    partial.index_fill_(0, rows, 0.0)
    if features is not None:
        partial.index_add_(0, rows, features.to(device=partial.device, dtype=torch.float32))
