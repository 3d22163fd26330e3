"""A layer's attention from its fused q/k/v product to the o product's input, on any kernel.

q and k are rotated (after their norms, where the family has them), k and v written to the KV pool
at the pass's slots, and the kernel attends. A kernel that does all three in one call (the C one:
tpserve/kernels/native_attention.py `rotate_store_attend`) gets qkv as it is; any other gets the
rotated heads, the KV write (tpserve/kernels/attention.py `write_kv`) and its `attend`. The two ways
compute the same numbers; the model's attention (tpserve/ranks/layers/attention.py) has one body.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpserve.kernels.attention import write_kv
from tpserve.kernels.attention_kernels import AttentionKernel
from tpserve.kernels.rotary import Rotary

Norm = Callable[[torch.Tensor], torch.Tensor]


def rotate_store_attend(
    kernel: AttentionKernel,
    qkv: torch.Tensor,
    num_q: int,
    qk_norms: tuple[Norm, Norm] | None,
    tables: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    plan,
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    num_real: int | None = None,
) -> torch.Tensor:
    """qkv: [rows, (Hq + 2 Hkv) * D] (q heads, k heads, v heads), the first num_real rows real (the
    rest a pass's padding, never written to the pool); qk_norms: q's and k's norms, or None; tables:
    the rotary's (cos, signed sin) for the rows; slots: [num_real] KV slots; pool_*: [Hkv, slots, D];
    plan: the kernel's plan of the pass; window: the layer's sliding window (0: none); sinks: [Hq]
    sink logits or None. Returns [rows, Hq * D]."""
    num_rows, (num_kv, _, head_dim) = qkv.shape[0], pool_k.shape
    if kernel.rotate_store_attend is not None:  # one call from here to the o product
        normed = None  # q and k read from qkv itself, unless normed first
        if qk_norms is not None:
            heads = qkv.view(num_rows, num_q + 2 * num_kv, head_dim)
            normed = (qk_norms[0](heads[:, :num_q]), qk_norms[1](heads[:, num_q : num_q + num_kv]))
        return kernel.rotate_store_attend(
            qkv, num_q, normed, tables, slots, pool_k, pool_v, plan, scale, window, sinks
        )
    heads = qkv.view(num_rows, num_q + 2 * num_kv, head_dim)  # q heads, k heads, v heads
    if qk_norms is None:  # q and k rotated together
        q, k = Rotary.apply(heads[:, : num_q + num_kv], tables).split((num_q, num_kv), dim=1)
    else:
        q = Rotary.apply(qk_norms[0](heads[:, :num_q]), tables)
        k = Rotary.apply(qk_norms[1](heads[:, num_q : num_q + num_kv]), tables)
    v = heads[:, num_q + num_kv :]
    padded = num_real is not None and num_real < num_rows
    write_kv(pool_k, pool_v, k[:num_real] if padded else k, v[:num_real] if padded else v, slots)
    return kernel.attend(q, pool_k, pool_v, plan, scale, window, sinks)
