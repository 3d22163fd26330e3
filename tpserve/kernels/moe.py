"""A mixture of experts' two steps: routing each token to k experts, and the sum of their outputs.

Exact by construction (DESIGN.md): a row's route and its sum depend on that row alone. The router's
product is tiled as every product is (tpserve/kernels/linear.py); the softmax and the top k are per row; an
expert's SwiGLU runs on the rows routed to it, gathered, and its products' rows do not depend on
how many rows share the expert (row tiles, or packed products); each row's weighted outputs are
added in increasing expert index, whatever the other rows chose. A piece holds every expert's slice
of the intermediate dimension, so its sum is a row-parallel partial like the dense MLP's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tpserve.kernels.linear import linear


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's: silu(gate) * up."""
    return F.silu(gate) * up


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's: gate clamped above at limit, up to [-limit, limit]; (up + 1) * gate * sigmoid(alpha
    * gate), in transformers' order of operations."""
    gate = gate.clamp(max=limit)  # [n, I]
    up = up.clamp(min=-limit, max=limit)
    # The sigmoid runs in a view whose rows lie apart (a row stride of I + 1): the CPU's loop then
    # takes each row alone, its vector part and scalar tail the same at any number of rows. On a
    # contiguous [n, I] the loop would run over n * I elements at once, the scalar tail (whose exp
    # rounds unlike the vector one) falling on other elements as n changes: a row's bits would
    # depend on the rows beside it. Clamps, sums and products round alike either way.
    sigmoid = _rows_apart(gate)
    torch.mul(gate, alpha, out=sigmoid).sigmoid_()
    return (up + 1) * (gate * sigmoid)


def _rows_apart(x: torch.Tensor) -> torch.Tensor:
    """An empty [n, m] like x whose rows lie apart (row stride m + 1): an elementwise op written
    into it runs row by row, so a row's bits do not depend on how many rows ran beside it."""
    return torch.empty(x.shape[0], x.shape[1] + 1, dtype=x.dtype, device=x.device)[:, :-1]


def sigmoid_by_rows(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) [n, m] in x's dtype, each row's computed on its own (see clamped_swiglu): GLM-4.5's
    router scores, Qwen2-MoE's shared-expert gate ([n, 1], in the model's dtype as transformers')."""
    return _rows_apart(x).copy_(x).sigmoid_()


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, k] float32, experts [T, k] int64): a softmax over every expert
    in float32, its k largest, renormalised to sum to one where the family does (Mixtral, and
    Qwen3-MoE's norm_topk_prob; the same as Mixtral's softmax over the k largest logits)."""
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route_top_logits(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the k largest logits [T, E], softmaxed among themselves in float32."""
    top, experts = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top.float(), dim=-1), experts


def route_grouped_sigmoid(
    logits: torch.Tensor,
    correction: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    normalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5's routing (DeepSeek-V3's "noaux_tc"): logits [T, E] float32, correction [E] float32
    -> (weights [T, k] float32, experts [T, k] int64). The choice reads sigmoid scores plus the
    correction: each group's score is the sum of its two best, the topk_group best groups are kept
    and the k best experts among theirs chosen. The weights are the chosen experts' sigmoid scores
    (no correction), renormalised where `normalize` (sum + 1e-20, as transformers does), times
    `scale`. Every step is per row; the k slots come in descending order of choice, a row's own."""
    scores = sigmoid_by_rows(logits)
    choice = scores + correction
    grouped = choice.view(choice.shape[0], num_groups, -1)  # [T, groups, E / groups]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
    kept = torch.zeros_like(group_scores, dtype=torch.bool)
    kept.scatter_(1, group_scores.topk(topk_group, dim=-1)[1], True)
    choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(scores)
    experts = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, experts


def routed_bias(weights: torch.Tensor, experts: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """Sum over each row's k chosen experts of weight * that expert's bias: [T, hidden] float32.
    biases: [E, hidden]. Added in the route's slot order, one slot at a time: a row's own order."""
    out = weights[:, 0:1] * biases[experts[:, 0]].float()
    for slot in range(1, experts.shape[1]):
        out = out + weights[:, slot : slot + 1] * biases[experts[:, slot]].float()
    return out


def expert_sum(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_ups: list,
    downs: list,
    row_tile: int,
    held: range | None = None,
    gate_up_biases: list | None = None,
    glu: Callable = silu_glu,
) -> torch.Tensor:
    """x: [T, hidden]; weights, experts: [T, k] (route's). gate_ups[e]: [2*I, hidden] (gate rows
    then up rows), downs[e]: [hidden, I]. Returns sum over each row's k experts, in increasing
    expert index, of weight * down(glu(gate, up)): [T, hidden] float32. held: the experts summed
    (expert parallelism's share, bench/moe_split.py); None: every expert, each in its slice.
    gate_up_biases[e]: [2*I] added to gate and up (gpt-oss; a down bias is added once, after the
    pieces' sums are reduced: routed_bias)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    # One loop step per expert some row chose (not per token): the rows routed to it, gathered.
    for expert in torch.unique(experts).tolist():  # sorted: the fixed order of each row's sum
        if held is not None and expert not in held:
            continue
        rows, slots = (experts == expert).nonzero(as_tuple=True)  # a row chooses an expert once
        bias = gate_up_biases[expert] if gate_up_biases is not None else None
        gate, up = linear(x[rows], gate_ups[expert], bias, row_tile).chunk(2, dim=-1)
        y = linear(glu(gate, up), downs[expert], None, row_tile)  # [n, hidden]
        out.index_add_(0, rows, y.float() * weights[rows, slots].unsqueeze(1))
    return out
