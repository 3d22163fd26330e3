"""Two ranks' mixture of experts: TP within experts against expert parallelism, one layer's critical path.

TP within experts (what tpserve/ranks/sharding.py does): every rank holds every expert's half of the
intermediate dimension, so each rank runs all k chosen experts of every row at half width; the two
ranks' work is the same whatever the routing. Expert parallelism: each rank holds half the experts
whole and runs only the chosen ones it holds; a layer waits for the busier rank. Both end in the
same all-reduce of [T, hidden] (the row-parallel sum), which is left out. Each rank's share is timed
on one thread through tpserve/kernels/moe.py's expert_sum, with `--layers` copies of the layer cycled so a
call reads its weights from memory as a decode step does; routes are drawn uniformly (a real
router's skew only adds to expert parallelism's imbalance). Reported: ms per layer of the critical
path (TP: rank 0's time, EP: the slower rank's), and EP / TP, at each row count, in one run.

    python -m bench.moe_split [--experts 32] [--top-k 4] [--hidden 768] [--expert-size 384]
                              [--rows 1 16] [--layers 4] [--samples 40] [--row-tile 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import finish, median, print_table  # noqa: E402
from tpserve.kernels.linear import ROW_TILE  # noqa: E402
from tpserve.kernels.moe import expert_sum, route  # noqa: E402


def layer_shares(num_experts: int, hidden: int, expert_size: int, gen) -> dict:
    """One layer's weights as each split gives them to rank 0 and rank 1."""
    gate, up = (torch.randn(num_experts, expert_size, hidden, generator=gen) * 0.05 for _ in range(2))
    down = torch.randn(num_experts, hidden, expert_size, generator=gen) * 0.05
    half = expert_size // 2
    tp = []
    for cols in (slice(0, half), slice(half, expert_size)):
        tp.append(
            (
                [torch.cat([gate[e, cols], up[e, cols]]).contiguous() for e in range(num_experts)],
                [down[e][:, cols].contiguous() for e in range(num_experts)],
            )
        )
    whole = ([torch.cat([gate[e], up[e]]) for e in range(num_experts)], [down[e] for e in range(num_experts)])
    return {"tp": tp, "ep": whole}


def run_moe_split(
    num_experts=32,
    top_k=4,
    hidden=768,
    expert_size=384,
    rows=(1, 16),
    num_layers=4,
    num_samples=40,
    row_tile=ROW_TILE,
) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    layers = [layer_shares(num_experts, hidden, expert_size, gen) for _ in range(num_layers)]
    halves = (range(0, num_experts // 2), range(num_experts // 2, num_experts))
    results = []
    for num_rows in rows:
        tp_ms, ep_ms, busier = [], [], []
        for sample in range(num_samples):
            layer = layers[sample % num_layers]
            x = torch.randn(num_rows, hidden, generator=gen)
            weights, experts = route(torch.randn(num_rows, num_experts, generator=gen), top_k, True)
            start = time.perf_counter()
            expert_sum(x, weights, experts, *layer["tp"][0], row_tile)
            tp_ms.append((time.perf_counter() - start) * 1e3)
            per_rank = []
            for held in halves:
                start = time.perf_counter()
                expert_sum(x, weights, experts, *layer["ep"], row_tile, held=held)
                per_rank.append((time.perf_counter() - start) * 1e3)
            ep_ms.append(max(per_rank))
            chosen = experts.flatten().tolist()
            busier.append(max(sum(e in held for e in chosen) for held in halves) / len(chosen))
        tp, ep = median(tp_ms), median(ep_ms)
        results.append(
            {
                "rows": num_rows,
                "tp_ms": tp,
                "ep_ms": ep,
                "ep_over_tp": ep / tp,
                "busier_share": median(busier),
            }
        )
    geometry = {
        "experts": num_experts,
        "top_k": top_k,
        "hidden": hidden,
        "expert_size": expert_size,
        "row_tile": row_tile,
    }
    return {"geometry": geometry, "layers": num_layers, "samples": num_samples, "results": results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--expert-size", type=int, default=384)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument(
        "--row-tile", type=int, default=ROW_TILE, help="0: products untiled (batch_invariant off)"
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report = run_moe_split(
        args.experts,
        args.top_k,
        args.hidden,
        args.expert_size,
        tuple(args.rows),
        args.layers,
        args.samples,
        args.row_tile,
    )
    print_table(
        f"one MoE layer's critical path, ms (median of {args.samples}): {report['geometry']}",
        ["rows", "TP within experts", "expert parallel", "EP/TP", "busier rank's share of routes"],
        [[r["rows"], r["tp_ms"], r["ep_ms"], r["ep_over_tp"], r["busier_share"]] for r in report["results"]],
    )
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
