"""Prompt-lookup draft tokens on versus off: one stream's decode speed, on text that repeats.

Two ranks through the real lane host, one engine per mode (`EngineSettings.draft_tokens` 0 and
`--draft-tokens`), modes in turn `--rounds` times. The chat asks the model to copy a passage, the
case drafts are for (quoting, editing, summarising); `--task free` asks an open question instead,
where drafts are rarely right and the figure shows what checking them costs. Replies must be
identical between the modes (the run exits 1 otherwise): drafts change speed, never tokens.

    python -m bench.drafts [--task copy|free --max-tokens 96 --rounds 1] [--json FILE]
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
    print_table,
    watch_streams,
)
from tpserve.ranks.settings import QUANTIZE_CHOICES  # noqa: E402
from tpserve.server.requests import GenerationRequest  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402
from tpserve.server.wiring import local_engine  # noqa: E402

PASSAGE = "The lane host admits waiting requests and runs one decode round over every live lane."
TASKS = {
    "copy": f"Repeat this sentence five times, one per line: {PASSAGE}",
    "free": "Write a short story about a lighthouse keeper.",
}


def run_mode(
    model_dir: str, prompt_ids: list[int], *, draft_tokens: int, max_tokens: int, dtype: str, quantize: str
):
    """One stream on a fresh engine: its decode speed (tokens after the first, per second), its
    tokens, and the drafts the host checked and kept."""
    settings = bench_settings(
        model_dir,
        dtype=dtype,
        tp_size=2,
        num_lanes=1,
        context_size=len(prompt_ids) + max_tokens,
        draft_tokens=draft_tokens,
        quantize=quantize,
    )
    request = GenerationRequest(tuple(prompt_ids), max_tokens, GREEDY, ignore_eos=True)
    with local_engine(settings) as engine:
        (record,) = watch_streams([engine.host.submit(request)])
        drafter = engine.host.drafter
        drafted = (drafter.num_drafted, drafter.num_accepted) if drafter else (0, 0)
    times = record.token_times
    speed = (len(times) - 1) / (times[-1] - times[0])
    return speed, record.token_ids, drafted


def run_drafts(
    model_dir: str,
    *,
    task: str = "copy",
    draft_tokens: int = 15,
    max_tokens: int = 96,
    num_rounds: int = 1,
    dtype: str = "float32",
    quantize: str = "none",
) -> dict:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": TASKS[task]}])
    speeds: dict[int, list[float]] = {0: [], draft_tokens: []}
    replies, drafted = {}, (0, 0)
    for _ in range(num_rounds):
        for mode in speeds:
            speed, tokens, counts = run_mode(
                model_dir,
                prompt_ids,
                draft_tokens=mode,
                max_tokens=max_tokens,
                dtype=dtype,
                quantize=quantize,
            )
            speeds[mode].append(speed)
            replies.setdefault(mode, tokens)
            drafted = counts if mode else drafted
    off, on = (median(speeds[mode]) for mode in speeds)
    return {
        "model": model_dir,
        "task": task,
        "dtype": dtype,
        "quantize": quantize,
        "max_tokens": max_tokens,
        "draft_tokens": draft_tokens,
        "rounds": num_rounds,
        "load_average": os.getloadavg()[0],
        "tokens_per_s_off": off,
        "tokens_per_s_on": on,
        "speed_on_over_off": on / off,
        "drafted": drafted[0],
        "accepted": drafted[1],
        "reply": tokenizer.decode(replies[0]),
        "replies_identical": replies[0] == replies[draft_tokens],
    }


def print_report(report: dict) -> None:
    print_table(
        f"one stream, task {report['task']}, 2 ranks, {report['dtype']}, {report['max_tokens']} tokens, "
        f"{report['rounds']} round(s), load average {report['load_average']:.1f}",
        ("draft_tokens", "decode tok/s"),
        [(0, report["tokens_per_s_off"]), (report["draft_tokens"], report["tokens_per_s_on"])],
    )
    print(f"drafts accepted: {report['accepted']} of {report['drafted']} (last round)")
    print(f"decode speed, drafts on / off: {report['speed_on_over_off']:.2f}x")
    print(f"replies identical between the modes: {report['replies_identical']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--task", choices=sorted(TASKS), default="copy")
    parser.add_argument("--draft-tokens", type=int, default=15, choices=range(1, 16), metavar="1..15")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1, help="times both modes run, in turn")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none")
    args = parser.parse_args(argv)
    report = run_drafts(
        args.model or default_model_dir(),
        task=args.task,
        draft_tokens=args.draft_tokens,
        max_tokens=args.max_tokens,
        num_rounds=args.rounds,
        dtype=args.dtype,
        quantize=args.quantize,
    )
    print_report(report)
    return finish(report, args.json, None if report["replies_identical"] else "the modes replied differently")


if __name__ == "__main__":
    raise SystemExit(main())
