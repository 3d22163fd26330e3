"""The start-up probe: batch invariance checked on the machine at hand, with the model's own shapes.

Batch-invariant mode rests on one property of the BLAS: a fixed-shape product computes a row the
same way wherever the row sits and whatever the other rows hold (tpserve/kernels/linear.py,
tpserve/kernels/tiled_attention.py). That is true of the BLASes we know, but it is a fact about a machine,
not about the code, so before serving every rank checks it with its own weights and attention
shapes: rows alone, in a small batch, in several tiles, at other tile positions; decode steps,
Verifies and chunks across key-block edges, read through a shuffled block table, against the whole
prefill over contiguous keys; the norms. The first row that
differs is a ProbeFailure naming the product's shape and how to serve without exactness.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.kernels.attention import SpanView
from tpserve.kernels.linear import linear
from tpserve.kernels.machine import describe_machine
from tpserve.kernels.norms import rms_norm
from tpserve.kernels.tiled_attention import KEY_BLOCK

PROBE_ROWS = 40  # three row tiles: a row alone, in a small batch, in the second and third tiles
PROBE_KEYS = 2 * KEY_BLOCK + 88  # across two key-block edges
# (start, length) of spans checked against the whole prefill: decode steps at block edges and near
# the start, a Verify, chunks, a round of them together.
_B = KEY_BLOCK
PROBE_SPANS = (
    *((p, 1) for p in (0, 1, 15, 16, _B - 1, _B, _B + 1, 2 * _B - 1, 2 * _B, PROBE_KEYS - 1)),
    (_B + 20, 16),  # a Verify
    (0, 100),  # chunks
    (_B, 33),
    (PROBE_KEYS - 188, 188),
)
PROBE_BLOCK = 16  # tokens per KV block of the shuffled pool the spans read through their tables
OFF_SWITCH = "serve without exactness with batch_invariant: false (flag --batch-invariant false)"


class ProbeFailure(Exception):
    """A product that rounds a row differently by its batch on this machine."""


def probe_model(model, *, product=linear, attention=None, kv_type: torch.dtype | None = None) -> None:
    """Raises ProbeFailure unless every product of `model` (a TPModel) is batch-invariant here.

    product and attention are the kernels checked (attention: the model's own unless given, with the
    model's plans, reading a pool of kv_type: the model's dtype unless given); tests pass a
    deliberately shape-dependent one.
    """
    gen = torch.Generator().manual_seed(0)
    first = model.layers[0]
    pieces = list(zip(first.self_attn.pieces, first.mlp.pieces))  # each piece's attention and MLP
    weights = [(f"{name} {tuple(w.shape)}", w, b) for piece in pieces for name, w, b in _linears(*piece)]
    weights += [(f"head {tuple(w.shape)}", w, None) for w in model.lm_head.weights]
    for name, weight, bias in weights:
        x = torch.randn(PROBE_ROWS, weight.shape[1], generator=gen).to(model.device, model.dtype)
        _check_rows(f"linear {name}", lambda rows, w=weight, b=bias: product(rows, w, b, model.row_tile), x)
    x = torch.randn(PROBE_ROWS, model.config.hidden_size, generator=gen).to(model.device, model.dtype)
    norm = model.norm.weight
    _check_rows("rms_norm", lambda rows: rms_norm(rows, norm, model.config.rms_norm_eps), x)
    cfg = model.config
    for num_kv_heads in sorted(
        {piece.num_kv_heads for piece in first.self_attn.pieces if piece.num_kv_heads}
    ):
        shape = (num_kv_heads, cfg.num_queries_per_kv, cfg.head_dim)
        attend = attention or model.attention.attend
        _check_attention(model.attention.plan, attend, *shape, model, kv_type or model.dtype, gen)


def _linears(attention, mlp):
    """A piece's products: its attention's (tpserve/ranks/layers/attention.py PieceAttention) and its MLP's
    or experts' (PieceMLP, PieceExperts: one expert's stand for all)."""
    return (
        ("qkv", attention.w_qkv, attention.b_qkv),
        ("o", attention.w_o, None),
        *((name, weight, None) for name, weight in mlp.probed()),
    )


def _check_rows(name: str, compute, x: torch.Tensor) -> None:
    whole = compute(x)
    cases = [(f"{n} rows", slice(0, n)) for n in (1, 2, 5, 16, 17)] + [
        (f"row {i} alone", slice(i, i + 1)) for i in (17, PROBE_ROWS - 1)
    ]
    for label, rows in cases:
        if not torch.equal(compute(x[rows]), whole[rows]):
            raise ProbeFailure(
                f"{name}: {label} differ from the same rows among {PROBE_ROWS} "
                f"({x.dtype}, {describe_machine()}); {OFF_SWITCH}"
            )


def _check_attention(
    make_plan, attention, num_kv_heads: int, group: int, head_dim: int, model, kv_type, gen
) -> None:
    dtype, device = model.dtype, model.device
    q = torch.randn(PROBE_KEYS, num_kv_heads * group, head_dim, generator=gen).to(device, dtype)
    k, v = (
        torch.randn(num_kv_heads, PROBE_KEYS, head_dim, generator=gen).to(device, kv_type) for _ in range(2)
    )

    def attend(queries, spans, pool=(k, v), block_size=1):
        plan = make_plan(spans, group, pool[0].shape[1], block_size, q.device, queries.shape[0])
        return attention(queries, *pool, plan, head_dim**-0.5).view(queries.shape)

    whole = attend(q, [SpanView(0, 0, PROBE_KEYS, tuple(range(PROBE_KEYS)))])
    # The rest read the same keys through a shuffled block table: the pool's blocks reordered
    # (padded to whole blocks), the table naming each position's new place.
    num_blocks = -(-PROBE_KEYS // PROBE_BLOCK)
    order = torch.randperm(num_blocks, generator=gen)
    slots = (order.unsqueeze(1) * PROBE_BLOCK + torch.arange(PROBE_BLOCK)).view(-1).to(device)
    shuffled = [F.pad(x, (0, 0, 0, num_blocks * PROBE_BLOCK - PROBE_KEYS))[:, slots] for x in (k, v)]
    table = tuple(torch.argsort(order).tolist())
    together, offset = [], 0
    for start, length in PROBE_SPANS:
        together.append(SpanView(offset, start, length, table))
        offset += length
    rounds = attend(torch.cat([q[s : s + n] for s, n in PROBE_SPANS]), together, shuffled, PROBE_BLOCK)
    for span, (start, length) in zip(together, PROBE_SPANS):
        alone = attend(q[start : start + length], [SpanView(0, start, length, table)], shuffled, PROBE_BLOCK)
        for label, rows in (
            ("alone", alone),
            ("beside other lanes", rounds[span.offset : span.offset + length]),
        ):
            if not torch.equal(rows, whole[start : start + length]):
                raise ProbeFailure(
                    f"{model.attention.name} attention ({num_kv_heads} KV heads x {group} queries, head_dim {head_dim}, "
                    f"{dtype}): {length} rows at position {start} {label} differ from the whole "
                    f"{PROBE_KEYS}-token prefill ({describe_machine()}); {OFF_SWITCH}"
                )


def shape_dependent_linear(x, weight, bias=None, row_tile=0):
    """A fault drill (EngineSettings.shape_dependent_on_rank): a product whose rows change with the
    batch, as an untiled BLAS call's may, so the probe's refusal can be tested on any machine."""
    out = linear(x, weight, bias, row_tile)
    return out + 1e-3 if x.shape[0] > 1 else out
