"""Matrix products whose rows do not depend on how many rows ran beside them.

A CPU BLAS picks its kernel, and the way it blocks a sum, by the shape of a product: one row, a few
rows and many rows round differently, and which shapes round alike differs from one CPU to another.
In batch-invariant mode every product is therefore cut into tiles of exactly `row_tile` rows (the
last one padded with zero rows), and each tile is its own [row_tile, in] x [in, out] product: the
one shape the BLAS ever sees for a weight, whatever the batch, so a row's numbers are the same alone,
in a decode round or inside a long prompt. The start-up probe (tpserve/ranks/probe.py) checks this on the
machine at hand. The price: padding rows, and a long prompt's product in tiles rather than at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from tpserve.kernels.int8_linear import PackedWeight

# Rows of every batch-invariant product (linear layers, the head and attention's tiles).
ROW_TILE = 16


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    row_tile: int = 0,
    num_real: int | None = None,
):
    # x: [T, in], weight: [out, in] -> [T, out]. num_real: rows past it are a pass's padding.
    if isinstance(weight, PackedWeight):
        # A row is the same at any batch there: no tiles, and the padding rows are left at zero
        # rather than computed (a decode step of one stream is 1 row of 16).
        if num_real is not None and num_real < x.shape[0]:
            return F.pad(weight(x[:num_real], bias), (0, 0, 0, x.shape[0] - num_real))
        return weight(x, bias)
    if not row_tile:
        return F.linear(x, weight, bias)
    num_rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -num_rows % row_tile)) if num_rows % row_tile else x
    num_tiles = padded.shape[0] // row_tile
    if x.dtype == torch.float32:
        # One batched call of num_tiles [row_tile, in] x [in, out] products, the weight shared
        # (stride 0), one tile or many: the same ops whatever the number of lanes.
        tiles = padded.view(num_tiles, row_tile, -1)
        out = torch.bmm(tiles, _shared(weight, num_tiles)).view(padded.shape[0], -1)
        if bias is not None:
            out += bias
    elif num_tiles == 1:
        out = F.linear(padded, weight, bias)
    else:  # bfloat16's batched call is slow on the CPU: one call per tile
        out = torch.cat([F.linear(tile, weight, bias) for tile in padded.split(row_tile)])
    return out[:num_rows] if num_rows % row_tile else out


# weight -> {num_tiles: its transpose expanded to [num_tiles, in, out]}: views made once per shape,
# so a product dispatches no op to make them.
_SHARED = WeakIdKeyDictionary()


def _shared(weight: torch.Tensor, num_tiles: int) -> torch.Tensor:
    views = _SHARED.setdefault(weight, {})
    if num_tiles not in views:
        views[num_tiles] = weight.t().expand(num_tiles, -1, -1)
    return views[num_tiles]
