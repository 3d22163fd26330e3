"""Batched prompt passes on versus off: 16 requests with 256-token prompts arriving together (issue 5).

Both modes run in one invocation on two ranks through the real lane host, one engine per mode
(EngineSettings.batch_prefill), with the same requests submitted in the same instant. With batching
the waiting prompts go through one joint prefill pass; without, one pass each. Reported per mode:
the time from submission to the last first token (the figure the feature exists for; target: at
most half with batching) and the p50/p90 time to each first token. Every reply must be identical
between the modes (half of the requests greedy, half sampled with a seed); the run exits 1 otherwise.

    python -m bench.batched_prefill [--requests 16 --prompt-tokens 256 --max-tokens N --rounds R] [--json FILE]
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
    add_common_args,
    bench_settings,
    default_model_dir,
    finish,
    median,
    percentile,
    print_table,
    submit_together,
    text_prompt,
    watch_streams,
)
from tpserve.kernels.sampling_params import SamplingParams  # noqa: E402
from tpserve.server.requests import GenerationRequest  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402
from tpserve.server.wiring import local_engine  # noqa: E402

MODES = (False, True)  # batch_prefill off first: a cold machine favours neither side


def make_requests(tokenizer: Tokenizer, num_requests: int, prompt_tokens: int, max_tokens: int):
    """Distinct prompts of exactly `prompt_tokens` ids; even-numbered greedy, odd ones sampled."""
    requests = []
    for index in range(num_requests):
        sampling = GREEDY if index % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.95, seed=index)
        prompt = tuple(text_prompt(tokenizer, index, prompt_tokens))
        requests.append(GenerationRequest(prompt, max_tokens, sampling, ignore_eos=True))
    return requests


def run_mode(
    model_dir: str,
    requests: Sequence[GenerationRequest],
    *,
    batch_prefill: bool,
    dtype: str,
    max_prefill_tokens: int,
) -> tuple[list[float], list[list[int]]]:
    """One engine, the requests submitted together: each one's time to first token and its reply."""
    longest = max(len(request.prompt_ids) + request.max_tokens for request in requests)
    settings = bench_settings(
        model_dir,
        dtype=dtype,
        tp_size=2,
        num_lanes=len(requests),
        context_size=longest,
        max_prefill_tokens=max_prefill_tokens,
        batch_prefill=batch_prefill,
    )
    with local_engine(settings) as engine:
        records = watch_streams(submit_together(engine.host, requests))
    first_token_s = [record.finished.usage.time_to_first_token_s for record in records]
    return first_token_s, [record.token_ids for record in records]


def run_batched_prefill(
    model_dir: str,
    *,
    num_requests: int = 16,
    prompt_tokens: int = 256,
    max_tokens: int = 8,
    num_rounds: int = 1,
    dtype: str = "float32",
    max_prefill_tokens: int = 0,
) -> dict:
    """Both modes in turn, `num_rounds` times, on the same requests; medians over rounds.

    The on/off ratio is taken per round (runs a few seconds apart) before its median.
    `max_prefill_tokens` 0: every prompt together, so the burst may go in one joint pass.
    """
    max_prefill_tokens = max_prefill_tokens or num_requests * prompt_tokens
    tokenizer = Tokenizer.from_model_dir(model_dir)
    requests = make_requests(tokenizer, num_requests, prompt_tokens, max_tokens)
    first_tokens: dict[bool, list[list[float]]] = {mode: [] for mode in MODES}
    differing: set[int] = set()
    expected = None
    for _ in range(num_rounds):
        for mode in MODES:
            first_token_s, replies = run_mode(
                model_dir, requests, batch_prefill=mode, dtype=dtype, max_prefill_tokens=max_prefill_tokens
            )
            first_tokens[mode].append(first_token_s)
            expected = expected or replies
            differing |= {i for i, (a, b) in enumerate(zip(expected, replies)) if a != b}
    modes = [
        {
            "batch_prefill": mode,
            "last_first_token_s": median([max(run) for run in first_tokens[mode]]),
            "first_token_p50_s": median([percentile(run, 50) for run in first_tokens[mode]]),
            "first_token_p90_s": median([percentile(run, 90) for run in first_tokens[mode]]),
            "round_first_token_s": first_tokens[mode],
        }
        for mode in MODES
    ]
    ratios = [max(on) / max(off) for off, on in zip(first_tokens[False], first_tokens[True])]
    return {
        "model": model_dir,
        "dtype": dtype,
        "tp_size": 2,
        "threads_per_rank": 1,
        "num_requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "max_prefill_tokens": max_prefill_tokens,
        "rounds": num_rounds,
        "load_average": os.getloadavg()[0],
        "modes": modes,
        "last_first_token_ratio": median(ratios),
        "round_last_first_token_ratios": ratios,
        "replies": expected,
        "replies_identical": not differing,
        "differing_requests": sorted(differing),
    }


def print_report(report: dict) -> None:
    print_table(
        f"{report['num_requests']} requests x {report['prompt_tokens']}-token prompts arriving together, "
        f"2 ranks, {report['dtype']}, 1 thread per rank, max_prefill_tokens {report['max_prefill_tokens']}, "
        f"{report['rounds']} round(s), "
        f"load average {report['load_average']:.1f}",
        ("batch_prefill", "last first token s", "p50 s", "p90 s"),
        [
            (m["batch_prefill"], m["last_first_token_s"], m["first_token_p50_s"], m["first_token_p90_s"])
            for m in report["modes"]
        ],
    )
    print(f"last first token, on / off: {report['last_first_token_ratio']:.3f} (target <= 0.5)")
    print(f"replies identical between the modes: {report['replies_identical']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--requests", type=int, default=16, help="requests arriving together (2 to 16)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=8, help="reply length, compared between modes")
    parser.add_argument("--rounds", type=int, default=1, help="times both modes run, in turn")
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=0,
        help="prompt tokens a step may prefill (default: all of them, so one joint pass can take the burst)",
    )
    args = parser.parse_args(argv)
    if not 2 <= args.requests <= 16:
        parser.error("--requests must be between 2 and 16 (one joint pass takes at most 16 prompts)")
    report = run_batched_prefill(
        args.model or default_model_dir(),
        num_requests=args.requests,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        num_rounds=args.rounds,
        dtype=args.dtype,
        max_prefill_tokens=args.max_prefill_tokens,
    )
    print_report(report)
    failure = f"requests {report['differing_requests']} replied differently with batched prefill"
    return finish(report, args.json, None if report["replies_identical"] else failure)


if __name__ == "__main__":
    raise SystemExit(main())
