"""A mixture of experts' two steps: routing each token to k experts, and the sum of their outputs.

Exact by construction (DESIGN.md): a row's route and its sum depend on that row alone. The router's
product is tiled as every product is (kernels/linear.py); the softmax and the top k are per row; an
expert's SwiGLU runs on the rows routed to it, gathered, and its products' rows do not depend on
how many rows share the expert (row tiles, or packed products); each row's weighted outputs are
added in increasing expert index, whatever the other rows chose. A piece holds every expert's slice
of the intermediate dimension, so its sum is a row-parallel partial like the dense MLP's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.kernels.linear import linear


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, k] float32, experts [T, k] int64): a softmax over every expert
    in float32, its k largest, renormalised to sum to one where the family does (Mixtral, and
    Qwen3-MoE's norm_topk_prob; the same as Mixtral's softmax over the k largest logits)."""
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def expert_sum(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_ups: list,
    downs: list,
    row_tile: int,
    held: range | None = None,
) -> torch.Tensor:
    """x: [T, hidden]; weights, experts: [T, k] (route's). gate_ups[e]: [2*I, hidden] (gate rows
    then up rows), downs[e]: [hidden, I]. Returns sum over each row's k experts, in increasing
    expert index, of weight * down(silu(gate) * up): [T, hidden] float32. held: the experts summed
    (expert parallelism's share, bench/moe_split.py); None: every expert, each in its slice."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    # One loop step per expert some row chose (not per token): the rows routed to it, gathered.
    for expert in torch.unique(experts).tolist():  # sorted: the fixed order of each row's sum
        if held is not None and expert not in held:
            continue
        rows, slots = (experts == expert).nonzero(as_tuple=True)  # a row chooses an expert once
        gate, up = linear(x[rows], gate_ups[expert], None, row_tile).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, downs[expert], None, row_tile)  # [n, hidden]
        out.index_add_(0, rows, y.float() * weights[rows, slots].unsqueeze(1))
    return out
