"""Matrix products whose rows do not depend on how many rows ran beside them.

The CPU BLAS picks a different kernel for 1 row, 2-15 rows and 16 or more, and the kernels round
differently; so a stream's logits would change with the batch it ran in. Padding every product to
at least `min_rows` rows keeps each row's arithmetic the same whatever the batch: a reply is then
exactly its solo run, at the price of computing the padding (1 to 15 spare rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The smallest row count of the BLAS's large-batch kernel (measured with MKL, float32 and bfloat16).
BATCH_INVARIANT_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int = 0):
    # x: [T, in], weight: [out, in] -> [T, out]
    num_rows = x.shape[0]
    if num_rows >= min_rows:
        return F.linear(x, weight, bias)
    padded = F.pad(x, (0, 0, 0, min_rows - num_rows))
    return F.linear(padded, weight, bias)[:num_rows]
