"""Operations per decode round: how many aten calls one round runs on rank 0, and how long it takes.

A round's cost on a CPU is mostly the number of small operations it dispatches, not their
arithmetic, so the hot path is counted (issue 12's target: at 32 lanes no more than 1.2x the count
at one lane, and at most 25 per layer). Rank 0's shard of a tp=2 pair is built in this process with
collectives that only count (no follower: the numbers are not checked, the calls are), its lanes
hold `--context`-token prompts, and one decode round over 1, 8, 16 and 32 lanes is counted with a
dispatch mode and timed without one.

    python -m bench.ops [--lanes 1 8 16 32] [--context 64] [--no-batch-invariant] [--quantize int4] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.common import add_common_args, default_model_dir, finish, median, print_table  # noqa: E402
from tpserve.kernels.attention_kernels import kv_dtype  # noqa: E402
from tpserve.kernels.linear import ROW_TILE  # noqa: E402
from tpserve.kernels.machine import machine_facts  # noqa: E402
from tpserve.kernels.weight_formats import auto_quantize  # noqa: E402
from tpserve.ranks.engine import Engine, open_lane
from tpserve.ranks.kv_store import KVPool  # noqa: E402
from tpserve.ranks.loader import load_rank_model  # noqa: E402
from tpserve.ranks.settings import DTYPE_CHOICES, QUANTIZE_CHOICES  # noqa: E402


class CountingCollectives:
    """Stands in for the follower: every collective is counted, none is sent."""

    def __init__(self):
        self.calls = 0

    def all_reduce_sum(self, x):
        self.calls += 1
        return x

    def gather_to_first(self, x):
        self.calls += 1
        return [x, x]


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--context", type=int, default=64, help="tokens each lane holds before the round")
    parser.add_argument("--tp", type=int, default=2, choices=(1, 2), help="count rank 0 of this tp")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per lane count")
    parser.add_argument("--no-batch-invariant", action="store_true")
    parser.add_argument(
        "--quantize", choices=QUANTIZE_CHOICES, default="auto", help="auto: the shipped config's"
    )
    parser.add_argument(
        "--kv-dtype", choices=DTYPE_CHOICES, default="auto", help="auto: the shipped config's"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.quantize == "auto":
        args.quantize = auto_quantize("cpu")
    model = load_rank_model(
        args.model or default_model_dir(),
        tp_rank=0,
        tp_size=args.tp,
        dtype=getattr(torch, args.dtype),
        max_positions=args.context + args.rounds + 10,
        collectives=CountingCollectives(),
        row_tile=0 if args.no_batch_invariant else ROW_TILE,
        quantize=args.quantize,
    )
    cfg = model.config
    kv_heads = [piece.num_kv_heads() for piece in model.pieces]
    kv_type = kv_dtype(args.kv_dtype, model.attention, model.dtype)
    capacity = args.context + args.rounds + 6
    rows, report = [], {"machine": machine_facts(), "settings": vars(args), "lanes": {}}
    for num_lanes in args.lanes:
        kv = KVPool(cfg.num_layers, num_lanes * capacity, kv_heads, cfg.head_dim, kv_type)
        engine = Engine(model, kv)
        for lane in range(num_lanes):
            open_lane(engine, lane, capacity)
            engine.forward([(lane, 0, tuple(range(100 + lane, 100 + lane + args.context)))])
        position = args.context

        def round_(position=position, engine=engine, num_lanes=num_lanes):
            return engine.forward([(lane, position, (7,)) for lane in range(num_lanes)])

        round_()  # warm: views made once per shape (tpserve/kernels/linear.py) are not a round's ops
        model.collectives.calls = 0
        with CountOps() as counter:
            round_(position + 1)
        collectives = model.collectives.calls
        times = []
        for step in range(2, args.rounds + 2):
            started = time.perf_counter()
            round_(position + step)
            times.append(time.perf_counter() - started)
        num_ops = sum(counter.counts.values())
        ms = median(times) * 1e3
        report["lanes"][num_lanes] = {
            "aten_ops": num_ops,
            "ops_per_layer": num_ops / cfg.num_layers,
            "collectives": collectives,
            "ms_per_round": ms,
            "round_ms": [t * 1e3 for t in times],
            "top_ops": counter.counts.most_common(12),
        }
        rows.append((num_lanes, num_ops, round(num_ops / cfg.num_layers, 1), collectives, ms, ms / num_lanes))
    print_table(
        f"one decode round on rank 0 of tp={args.tp} ({'fast' if args.no_batch_invariant else 'exact'})",
        ("lanes", "aten ops", "ops/layer", "collectives", "ms/round", "ms/lane"),
        rows,
    )
    first, last = args.lanes[0], args.lanes[-1]
    ratio = report["lanes"][last]["aten_ops"] / report["lanes"][first]["aten_ops"]
    report["ops_ratio_last_over_first"] = ratio
    print(f"aten ops at {last} lanes / at {first}: {ratio:.2f}")
    for name, count in report["lanes"][first]["top_ops"]:
        print(f"  {count:5d} {name}")
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
