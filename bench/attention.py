"""The C attention kernel's paths side by side: ms per layer call, and ms per decode round of the model.

tpserve/kernels/native/attention.c runs a plain path, an AVX2 path and an AVX-512 path, which give the same
bits (tests/test_attention.py); this times each path this CPU runs against the plain one, pass
after pass, each case's median kept:
- kernel: one layer call on rank 0's 2 KV heads of SmolLM2 (3 query heads each, head_dim 64): a decode
  round of 1 or 16 lanes at 64, 512 and 1500 keys, and a 600-token prefill;
- rounds (--rounds): bench/ops.py's decode round of the shipped model on rank 0 of tp=2, at 1 and 16
  lanes, with each lane holding `--context` tokens: on the plain path over a float32 KV pool, on
  the fastest path over float32, and on the fastest over float16 (kv_dtype auto's choice here).
One thread.

With --blocks, instead: one layer call of the default model's whole attention (3 KV heads, tp=1) on
the fastest path over a float16 pool, each lane's keys in one contiguous range against shuffled block
tables of 8 to 128 tokens a block (a decode round of 16 lanes at 512 and 1500 keys, one lane at 1500,
a 256-token chunk after 512 keys, a 512-token prompt), layouts interleaved call by call, medians, with
what each block size wastes (half a block a stream).

    python -m bench.attention [--passes 7] [--rounds] [--context 64 512 1500] [--blocks] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import finish, median, print_table  # noqa: E402
from tpserve.kernels.attention import SpanView  # noqa: E402
from tpserve.kernels.native_attention import (  # noqa: E402
    NativePlan,
    attention_paths,
    native_attention,
    use_attention_path,
)

NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 64  # SmolLM2-135M, one rank of tp=2
BLOCK_KV_HEADS = 3  # the whole model's (tp=1), for --blocks
BLOCK_SIZES = (8, 16, 32, 64, 128)  # tokens per KV block, for --blocks
BLOCK_CASES = ((512, 16, 1), (1500, 16, 1), (1500, 1, 1), (512, 1, 256), (0, 1, 512))  # keys, lanes, tokens
CASES = (
    (64, 1, 1),
    (512, 1, 1),
    (1500, 1, 1),
    (160, 16, 1),
    (1500, 16, 1),
    (0, 1, 600),
)  # keys, lanes, tokens


def time_kernel(num_keys: int, num_lanes: int, num_tokens: int, paths: list[str], num_passes: int) -> dict:
    """ms per call on each path: each of `num_lanes` lanes adds `num_tokens` tokens after `num_keys`."""
    per_lane = num_keys + num_tokens
    gen = torch.Generator().manual_seed(num_keys + num_lanes)
    pool_k, pool_v = (
        torch.randn(NUM_KV_HEADS, per_lane * num_lanes, HEAD_DIM, generator=gen) for _ in range(2)
    )
    spans = [
        SpanView(i * num_tokens, num_keys, num_tokens, _range(i * per_lane, per_lane))
        for i in range(num_lanes)
    ]
    plan = NativePlan(spans, GROUP, per_lane * num_lanes, 1)
    q = torch.randn(num_lanes * num_tokens, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    work = num_lanes * num_tokens * (num_keys + (num_tokens + 1) / 2)  # rows x keys each sees
    calls = max(1, int(200_000 // work))
    samples: dict[str, list[float]] = {path: [] for path in paths}
    try:
        for _ in range(num_passes):
            for path in paths:
                use_attention_path(path)
                start = time.perf_counter()
                for _ in range(calls):
                    native_attention(q, pool_k, pool_v, plan, HEAD_DIM**-0.5)
                samples[path].append((time.perf_counter() - start) * 1e3 / calls)
    finally:
        use_attention_path(None)
    ms = {path: median(values) for path, values in samples.items()}
    return {"keys": num_keys, "lanes": num_lanes, "tokens": num_tokens, "ms": ms}


def _range(first: int, num_slots: int) -> tuple[int, ...]:
    """The table of a lane holding slots first.. as one-slot blocks (the contiguous layout)."""
    return tuple(range(first, first + num_slots))


def paged_lanes(num_lanes: int, per_lane: int, block_size: int, gen) -> tuple[int, list[tuple[int, ...]]]:
    """Slots of a pool holding num_lanes lanes of per_lane tokens in blocks of block_size, and each
    lane's table: every block of the pool given to a lane at random, so no two of a lane's blocks are
    neighbours but by chance (a pool long in service: blocks freed and taken in any order)."""
    per_table = -(-per_lane // block_size)
    ids = torch.randperm(num_lanes * per_table, generator=gen).tolist()
    return len(ids) * block_size, [tuple(ids[i * per_table : (i + 1) * per_table]) for i in range(num_lanes)]


def time_blocks(num_keys: int, num_lanes: int, num_tokens: int, path: str, num_passes: int) -> dict:
    """ms per layer call (and per plan, built once a pass) over the contiguous layout and over shuffled
    block tables at each of BLOCK_SIZES: each of num_lanes lanes adds num_tokens after num_keys, the
    default model's whole attention (3 KV heads x 3 queries, head_dim 64), float16 pool."""
    per_lane = num_keys + num_tokens
    gen = torch.Generator().manual_seed(per_lane + num_lanes)
    layouts = {
        "contiguous": (per_lane * num_lanes, 1, [_range(i * per_lane, per_lane) for i in range(num_lanes)])
    }
    for block_size in BLOCK_SIZES:
        slots, tables = paged_lanes(num_lanes, per_lane, block_size, gen)
        layouts[block_size] = (slots, block_size, tables)
    q = torch.randn(num_lanes * num_tokens, BLOCK_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    pools = {
        name: [torch.randn(BLOCK_KV_HEADS, slots, HEAD_DIM, generator=gen).half() for _ in range(2)]
        for name, (slots, _, _) in layouts.items()
    }
    work = num_lanes * num_tokens * (num_keys + (num_tokens + 1) / 2)
    calls = max(3, int(300_000 // work))
    samples = {name: ([], []) for name in layouts}
    use_attention_path(path)
    try:
        # Layouts interleaved call by call, so a shared machine's load falls on each alike; each
        # call's plan built anew, as each pass builds its own.
        for _ in range(num_passes * calls):
            for name, (slots, block_size, tables) in layouts.items():
                start = time.perf_counter()
                spans = [SpanView(i * num_tokens, num_keys, num_tokens, t) for i, t in enumerate(tables)]
                plan = NativePlan(spans, GROUP, slots, block_size)
                planned = time.perf_counter()
                native_attention(q, *pools[name], plan, HEAD_DIM**-0.5)
                samples[name][0].append((time.perf_counter() - planned) * 1e3)
                samples[name][1].append((planned - start) * 1e3)
    finally:
        use_attention_path(None)
    return {
        "keys": num_keys,
        "lanes": num_lanes,
        "tokens": num_tokens,
        "ms": {str(name): median(times) for name, (times, _) in samples.items()},
        "plan_ms": {str(name): median(plans) for name, (_, plans) in samples.items()},
    }


def print_blocks(results: list[dict]) -> None:
    print_table(
        "C attention through block tables, one layer call of the default model (3 KV heads x 3 queries, "
        "head_dim 64, float16 pool, one thread), ms; x: contiguous / shuffled (below 1: slower); "
        "plan: ms to build the pass's plan",
        [
            "keys",
            "lanes",
            "tokens",
            "block",
            "contiguous",
            "shuffled",
            "x",
            "plan contiguous",
            "plan shuffled",
        ],
        [
            [
                r["keys"],
                r["lanes"],
                r["tokens"],
                size,
                r["ms"]["contiguous"],
                r["ms"][str(size)],
                r["ms"]["contiguous"] / r["ms"][str(size)],
                r["plan_ms"]["contiguous"],
                r["plan_ms"][str(size)],
            ]
            for r in results
            for size in BLOCK_SIZES
        ],
    )
    bytes_per_token = 2 * 30 * 3 * HEAD_DIM * 2  # SmolLM2-135M: k and v, 30 layers, 3 KV heads, float16
    print_table(
        "waste: a stream's last block is on average half empty ((block - 1) / 2 slots)",
        ["block", "slots / stream", "KiB / stream", "% of 512 tokens", "% of 2048 tokens"],
        [
            [
                size,
                (size - 1) / 2,
                (size - 1) / 2 * bytes_per_token / 1024,
                50 * (size - 1) / 512,
                50 * (size - 1) / 2048,
            ]
            for size in BLOCK_SIZES
        ],
    )


def time_rounds(contexts: list[int], variants: list[tuple[str, str]], num_passes: int) -> list[dict]:
    """bench/ops.py's ms per decode round at 1 and 16 lanes for each (path, KV dtype), passes interleaved."""
    from bench import ops

    samples: dict[tuple[int, tuple[str, str]], list[list[float]]] = {}
    try:
        for _ in range(num_passes):
            for context in contexts:
                for path, kv in variants:
                    use_attention_path(path)
                    with tempfile.NamedTemporaryFile(suffix=".json") as out:
                        argv = [
                            "--lanes",
                            "1",
                            "16",
                            "--context",
                            str(context),
                            "--kv-dtype",
                            kv,
                            "--json",
                            out.name,
                        ]
                        with contextlib.redirect_stdout(io.StringIO()):
                            ops.main(argv)
                        lanes = json.loads(Path(out.name).read_text())["lanes"]
                    samples.setdefault((context, (path, kv)), []).append(
                        [lanes[n]["ms_per_round"] for n in ("1", "16")]
                    )
    finally:
        use_attention_path(None)
    return [
        {"context": context, "path": path, "kv_dtype": kv, "ms_per_round": [median(c) for c in zip(*rows)]}
        for (context, (path, kv)), rows in samples.items()
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--rounds", action="store_true", help="also time the model's decode rounds")
    parser.add_argument("--context", type=int, nargs="+", default=[64, 512, 1500])
    parser.add_argument("--json", metavar="FILE", default=None)
    parser.add_argument(
        "--blocks",
        action="store_true",
        help="time shuffled block tables against the contiguous layout instead",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    paths = attention_paths()
    if args.blocks:
        report = {
            "path": paths[-1],
            "blocks": [time_blocks(*case, paths[-1], args.passes) for case in BLOCK_CASES],
        }
        print_blocks(report["blocks"])
        return finish(report, args.json)
    report = {"paths": paths, "kernel": [time_kernel(*case, paths, args.passes) for case in CASES]}
    print_table(
        "C attention, one layer call (rank 0 of tp=2: 2 KV heads x 3 queries), ms; x: plain / path",
        ["keys", "lanes", "tokens", *paths, *(f"x {p}" for p in paths[1:])],
        [
            [
                r["keys"],
                r["lanes"],
                r["tokens"],
                *(r["ms"][p] for p in paths),
                *(r["ms"]["plain"] / r["ms"][p] for p in paths[1:]),
            ]
            for r in report["kernel"]
        ],
    )
    if args.rounds:
        # the plain path over float32 (this kernel before its vector paths), the fastest path over
        # float32, and the fastest over float16 (the shipped kv_dtype here)
        variants = [("plain", "float32"), (paths[-1], "float32"), (paths[-1], "float16")]
        report["rounds"] = time_rounds(args.context, variants, max(1, args.passes // 3))
        by = {(r["context"], (r["path"], r["kv_dtype"])): r["ms_per_round"] for r in report["rounds"]}
        names = [f"{path} {kv}" for path, kv in variants]
        print_table(
            "decode round of the shipped model, rank 0 of tp=2, ms at 1 and 16 lanes; x: the first / the last",
            ["context", "lanes", *names, "x"],
            [
                [
                    c,
                    lanes,
                    *(by[c, v][i] for v in variants),
                    by[c, variants[0]][i] / by[c, variants[-1]][i],
                ]
                for c in args.context
                for i, lanes in enumerate((1, 16))
            ],
        )
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
