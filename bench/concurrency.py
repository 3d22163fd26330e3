"""Aggregate decode speed at 1, 4, 8 and 16 concurrent streams on two ranks (issue 3).

The streams go through the real lane host (`local_engine`: rank 0 in this process, the follower as
a child process), all submitted in the same instant, each with ignore_eos and the same max_tokens.
Prefill is left out by timing a window in which every stream is decoding: from the moment the last
stream got its first token to the moment the first stream got its last. Tokens/s counts every token
that arrived inside that window. Every concurrency runs on the same engine, in turn, so the ratios to
one stream compare like with like (target: 8 streams give at least 4x the tokens/s of one).

    python -m bench.concurrency [--streams 1 4 8 16] [--max-tokens N] [--rounds R] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    GREEDY,
    StreamRecord,
    add_common_args,
    bench_settings,
    chat_prompt,
    default_model_dir,
    finish,
    median,
    print_table,
    submit_together,
    watch_streams,
)
from tpserve.ranks.settings import QUANTIZE_CHOICES  # noqa: E402
from tpserve.server.requests import GenerationRequest  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402
from tpserve.server.wiring import local_engine  # noqa: E402

MIN_LANES = 16


def decode_window(records: Sequence[StreamRecord]) -> tuple[int, float]:
    """(tokens, seconds) while every stream was decoding: after the last first token, up to the
    first last token. ValueError when the streams never all decoded at once."""
    start = max(record.token_times[0] for record in records)
    end = min(record.token_times[-1] for record in records)
    if end <= start:
        raise ValueError(
            "no moment when every stream was decoding (prefill took longer than the replies): raise max_tokens"
        )
    num_tokens = sum(1 for record in records for t in record.token_times if start < t <= end)
    return num_tokens, end - start


def run_concurrency(
    model_dir: str,
    *,
    stream_counts: Sequence[int] = (1, 4, 8, 16),
    max_tokens: int = 32,
    num_rounds: int = 1,
    dtype: str = "float32",
    batch_invariant: bool = True,
    quantize: str = "none",
) -> dict:
    """Each stream count once per round on one two-rank engine; median tokens/s over rounds."""
    num_lanes = max(MIN_LANES, *stream_counts)
    with local_engine(
        bench_settings(
            model_dir,
            dtype=dtype,
            tp_size=2,
            num_lanes=num_lanes,
            context_size=_context_size(model_dir, num_lanes, max_tokens),
            batch_invariant=batch_invariant,
            quantize=quantize,
        )
    ) as engine:
        prompts = [chat_prompt(engine.tokenizer, index) for index in range(num_lanes)]
        rates: dict[int, list[float]] = {count: [] for count in stream_counts}
        rounds_ms: dict[int, list[float]] = {count: [] for count in stream_counts}
        for _ in range(num_rounds):
            for count in stream_counts:
                requests = [
                    GenerationRequest(tuple(prompts[i]), max_tokens, GREEDY, ignore_eos=True)
                    for i in range(count)
                ]
                records = watch_streams(submit_together(engine.host, requests))
                if any(len(record.token_ids) != max_tokens for record in records):
                    raise RuntimeError(f"{count} streams: a reply was not {max_tokens} tokens long")
                num_tokens, seconds = decode_window(records)
                rates[count].append(num_tokens / seconds)
                rounds_ms[count].append(1000 * seconds * count / num_tokens)
    one = median(rates[stream_counts[0]])
    rows = [
        {
            "streams": count,
            "tokens_per_s": median(rates[count]),
            "ratio_to_first": median(rates[count]) / one,
            "ms_per_round": median(rounds_ms[count]),
            "round_tokens_per_s": rates[count],
        }
        for count in stream_counts
    ]
    return {
        "model": model_dir,
        "dtype": dtype,
        "tp_size": 2,
        "threads_per_rank": 1,
        "batch_invariant": batch_invariant,
        "num_lanes": num_lanes,
        "max_tokens": max_tokens,
        "rounds": num_rounds,
        "load_average": os.getloadavg()[0],
        "levels": rows,
    }


def _context_size(model_dir: str, num_lanes: int, max_tokens: int) -> int:
    """Room for the longest of the prompts plus the reply."""
    tokenizer = Tokenizer.from_model_dir(model_dir)
    return max(len(chat_prompt(tokenizer, index)) for index in range(num_lanes)) + max_tokens


def print_report(report: dict) -> None:
    first = report["levels"][0]["streams"]
    print_table(
        f"aggregate decode on 2 ranks, {report['dtype']}, 1 thread per rank, "
        f"batch_invariant={report['batch_invariant']}, max_tokens={report['max_tokens']}, "
        f"{report['rounds']} round(s), load average {report['load_average']:.1f}",
        ("streams", "tok/s", f"x {first} stream(s)", "ms/round"),
        [(r["streams"], r["tokens_per_s"], r["ratio_to_first"], r["ms_per_round"]) for r in report["levels"]],
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens every reply runs to")
    parser.add_argument("--rounds", type=int, default=1, help="times every stream count runs, in turn")
    parser.add_argument("--no-batch-invariant", action="store_true", help="the BLAS's fastest kernels")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none")
    args = parser.parse_args(argv)
    if min(args.streams) < 1:
        parser.error("--streams must be at least 1")
    report = run_concurrency(
        args.model or default_model_dir(),
        stream_counts=tuple(args.streams),
        max_tokens=args.max_tokens,
        num_rounds=args.rounds,
        dtype=args.dtype,
        batch_invariant=not args.no_batch_invariant,
        quantize=args.quantize,
    )
    print_report(report)
    return finish(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
