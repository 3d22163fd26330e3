"""Inter-token gaps of decoding streams while a long prompt arrives and fills.

One two-rank engine (local_engine, the real lane host) decodes `--streams` chat replies; once every
one of them has its first tokens, one prompt of `--prompt-tokens` tokens arrives and is prefilled in
chunks. Reported: the decoders' median gap between tokens, their largest gap while the long prompt
filled (from its submission to its first token), the ratio of the two (the target: at most 2), and
the long prompt's time to first token, for each `--step-tokens` budget (the rows a decode round
and the chunk riding in it carry; 0: none, a whole max_prefill_tokens chunk), side by side in one
run. The script uses only the lane host's public calls, so the same file measures an older tree
(copy it there, with `--step-tokens 0`) for the before-and-after figures.

    python -m bench.long_prompt_gap [--streams 15 --prompt-tokens 2000] [--step-tokens 0 64 128]
        [--quantize int4] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    GREEDY,
    add_common_args,
    bench_settings,
    chat_prompt,
    default_model_dir,
    finish,
    median,
    print_table,
    text_prompt,
    watch_streams,
)
from tpserve.ranks.settings import EngineSettings  # noqa: E402
from tpserve.server.requests import GenerationRequest  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402
from tpserve.server.wiring import local_engine  # noqa: E402


def run_gap(
    model_dir: str,
    *,
    num_streams: int,
    prompt_tokens: int,
    max_prefill_tokens: int,
    dtype: str,
    quantize: str,
    step_tokens: int,
) -> dict:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    budget = {"step_tokens": step_tokens} if step_tokens else {}  # an older tree has no such setting
    settings = bench_settings(
        model_dir,
        dtype=dtype,
        quantize=quantize,
        tp_size=2,
        num_lanes=num_streams + 1,
        context_size=prompt_tokens + 256,
        max_prefill_tokens=max_prefill_tokens,
        **budget,
    )
    if not step_tokens and "step_tokens" in EngineSettings.__dataclass_fields__:
        settings = replace(settings, step_tokens=prompt_tokens + 16 * (num_streams + 1))  # no cap
    decoders = [
        GenerationRequest(tuple(chat_prompt(tokenizer, i)), 200, GREEDY, ignore_eos=True)
        for i in range(num_streams)
    ]
    long_request = GenerationRequest(tuple(text_prompt(tokenizer, 77, prompt_tokens)), 4, GREEDY)
    with local_engine(settings) as engine:
        streams = [engine.host.submit(r) for r in decoders]
        for stream in streams:
            stream.next_event(timeout=300)  # each decoder is running
        time.sleep(0.5)  # a few rounds of steady decoding
        arrived = time.perf_counter()
        late = engine.host.submit(long_request)
        records = watch_streams([*streams, late])
    *decoding, long_record = records
    first_token = long_record.token_times[0]
    gaps, during = [], []
    for record in decoding:
        for before, after in zip(record.token_times, record.token_times[1:]):
            gaps.append(after - before)
            if after >= arrived and before <= first_token:
                during.append(after - before)
    median_gap = median(gaps)
    return {
        "model": model_dir,
        "streams": num_streams,
        "prompt_tokens": prompt_tokens,
        "max_prefill_tokens": max_prefill_tokens,
        "step_tokens": step_tokens,
        "median_gap_s": median_gap,
        "largest_gap_during_prefill_s": max(during),
        "gap_ratio": max(during) / median_gap,
        "long_prompt_first_token_s": first_token - arrived,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--streams", type=int, default=15, help="decoding streams")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="the long prompt's tokens")
    parser.add_argument("--max-prefill-tokens", type=int, default=512, help="the engine's chunk size")
    parser.add_argument(
        "--step-tokens", type=int, nargs="+", default=[0, 64, 128], help="budgets to compare (0: no cap)"
    )
    parser.add_argument("--quantize", default="int4", help="the weights' format (the shipped default's)")
    args = parser.parse_args(argv)
    runs = [
        run_gap(
            args.model or default_model_dir(),
            num_streams=args.streams,
            prompt_tokens=args.prompt_tokens,
            max_prefill_tokens=args.max_prefill_tokens,
            dtype=args.dtype,
            quantize=args.quantize,
            step_tokens=step_tokens,
        )
        for step_tokens in args.step_tokens
    ]
    print_table(
        f"{args.streams} decoding streams, a {args.prompt_tokens}-token prompt arrives "
        f"(chunks of at most {args.max_prefill_tokens})",
        (
            "step tokens",
            "median gap s",
            "largest gap while it fills s",
            "ratio (target <= 2)",
            "its first token s",
        ),
        [
            (
                run["step_tokens"] or "no cap",
                run["median_gap_s"],
                run["largest_gap_during_prefill_s"],
                run["gap_ratio"],
                run["long_prompt_first_token_s"],
            )
            for run in runs
        ],
    )
    return finish({"runs": runs}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
