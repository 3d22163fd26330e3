"""What a long prompt's chunk costs beside a decode round: the evidence for `step_tokens`.

Rank 0 of a tp=2 pair is built in this process (collectives that only count, as bench.ops), its
`--lanes` lanes hold `--context`-token histories, and one decode round over them is timed alone and
with a prompt chunk of each `--chunks` size in the same pass (Engine.mixed, what a step runs). Each
figure is the fastest of `--rounds` tries, so a busy machine inflates them less; the ratios are
what matter: a decoding stream's gap while a prompt fills is the mixed pass's time, its usual gap the
round's, so the issue's target (largest gap at most 2x the median) wants a ratio well under 2.

    python -m bench.step_budget [--lanes 15] [--chunks 16 32 64 128 256 512] [--prompt-tokens 2000] [--json FILE]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import add_common_args, default_model_dir, finish, print_table  # noqa: E402
from bench.ops import CountingCollectives  # noqa: E402
from tpserve.kernels.attention_kernels import kv_dtype  # noqa: E402
from tpserve.kernels.linear import ROW_TILE  # noqa: E402
from tpserve.kernels.weight_formats import auto_quantize  # noqa: E402
from tpserve.ranks.engine import Engine, open_lane
from tpserve.ranks.kv_store import KVPool  # noqa: E402
from tpserve.ranks.loader import load_rank_model  # noqa: E402


def fastest(run, tries: int) -> float:
    times = []
    for _ in range(tries):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--lanes", type=int, default=15, help="decoding streams")
    parser.add_argument("--context", type=int, default=256, help="tokens each decoding lane holds")
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 48, 64, 96, 128, 256, 512])
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="the long prompt, for its fill time")
    parser.add_argument("--rounds", type=int, default=7, help="tries per figure (the fastest counts)")
    parser.add_argument(
        "--quantize", default="auto", help="the weights' format (auto: the shipped CPU default)"
    )
    args = parser.parse_args(argv)
    quantize = auto_quantize("cpu") if args.quantize == "auto" else args.quantize
    model = load_rank_model(
        args.model or default_model_dir(),
        tp_rank=0,
        tp_size=2,
        dtype=getattr(torch, args.dtype),
        max_positions=args.context + args.prompt_tokens + 64,
        collectives=CountingCollectives(),
        row_tile=ROW_TILE,
        quantize=quantize,
    )
    cfg = model.config
    kv_heads = [piece.num_kv_heads() for piece in model.pieces]
    capacity = args.context + 8
    long_lane, long_capacity = args.lanes, max(args.chunks) + 8
    kv = KVPool(
        cfg.num_layers,
        (args.lanes + 1) * (max(capacity, long_capacity) + 64),
        kv_heads,
        cfg.head_dim,
        kv_dtype("auto", model.attention, model.dtype),
    )
    engine = Engine(model, kv)
    for lane in range(args.lanes):
        open_lane(engine, lane, capacity)
        engine.forward([(lane, 0, tuple(range(100 + lane, 100 + lane + args.context)))])
    steps = [(lane, args.context, (7,), ()) for lane in range(args.lanes)]
    open_lane(engine, long_lane, long_capacity)

    def round_alone():
        engine.decode_round(steps)
        for lane in range(args.lanes):  # the same position each try: the lane's last token rewritten
            engine.lanes[lane].length = args.context

    def with_chunk(size: int):
        def run():
            engine.mixed(steps, False, [(long_lane, 0, tuple(range(300, 300 + size)), ())])
            for lane in range(args.lanes):
                engine.lanes[lane].length = args.context
            engine.lanes[long_lane].length = 0

        return run

    round_alone()  # warm
    base = fastest(round_alone, args.rounds)
    rows, report = [], {"settings": vars(args) | {"quantize": quantize}, "round_ms": base * 1e3, "chunks": {}}
    rows.append(("none", base * 1e3, 1.0, "-"))
    for size in args.chunks:
        with_chunk(size)()  # warm the shape
        took = fastest(with_chunk(size), args.rounds)
        fill_s = math.ceil(args.prompt_tokens / size) * took
        report["chunks"][size] = {"ms": took * 1e3, "ratio": took / base, "fill_s": fill_s}
        rows.append((size, took * 1e3, took / base, fill_s))
    print_table(
        f"a decode round over {args.lanes} lanes, alone and with a prompt chunk in the same pass "
        f"(rank 0 of tp=2, {quantize}, fastest of {args.rounds})",
        ("chunk tokens", "pass ms", "x the round alone", f"{args.prompt_tokens}-token fill s"),
        rows,
    )
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
