"""Forward collectives between two CPU ranks on one host: shared memory versus gloo, with tp=1 beside.

Each mode starts its ranks (`cpu_collectives` gloo or shared_memory at tp=2; tp=1 has none), times
the prefill of one `--prompt-tokens` prompt `--prefills` times, then one stream's decode over
`--bursts` bursts of `--tokens` steps. Modes run in turn, `--rounds` times; medians over the samples.
The ratios printed are taken between modes of the same run; every mode's tokens must be identical
(the collectives change no bit), or the run exits 1.

    python -m bench.collectives [--prompt-tokens 256 --tokens 16 --bursts 3 --rounds 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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
    text_prompt,
)
from tpserve.generate import open_single_lane, single_stream_leader  # noqa: E402
from tpserve.server.backend import DecodeItem, PrefillItem  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402

LANE = 0
MODES = (("tp=2 gloo", 2, "gloo"), ("tp=2 shared memory", 2, "shared_memory"), ("tp=1", 1, "auto"))


def sample_mode(model_dir, tp_size, choice, prompt_ids, *, dtype, num_prefills, num_bursts, burst_tokens):
    """Prefill times (s), decode burst speeds (tok/s) and the tokens of one mode's run."""
    num_tokens = num_bursts * burst_tokens + 1
    settings = bench_settings(
        model_dir,
        dtype=dtype,
        tp_size=tp_size,
        num_lanes=1,
        context_size=len(prompt_ids) + num_tokens,
        max_prefill_tokens=len(prompt_ids),
        cpu_collectives=choice,
    )
    prefill_s, tokens_per_s, token_ids = [], [], []
    with single_stream_leader(settings) as leader:
        for attempt in range(num_prefills + 1):  # attempt 0 warms up, untimed
            if not open_single_lane(leader, LANE, len(prompt_ids) + num_tokens):
                raise RuntimeError(f"no room for one stream of {len(prompt_ids) + num_tokens} tokens")
            start = time.perf_counter()
            token = leader.prefill(PrefillItem(LANE, 0, tuple(prompt_ids), True, GREEDY))
            if attempt:
                prefill_s.append(time.perf_counter() - start)
            if attempt < num_prefills:
                leader.close(LANE)
        position = len(prompt_ids)
        for _ in range(num_bursts):
            start = time.perf_counter()
            for _ in range(burst_tokens):
                (token,) = leader.decode([DecodeItem(LANE, position, token, GREEDY)])
                position += 1
                token_ids.append(token)
            tokens_per_s.append(burst_tokens / (time.perf_counter() - start))
        leader.close(LANE)
    return prefill_s, tokens_per_s, token_ids


def run_collectives(
    model_dir: str,
    *,
    prompt_tokens: int = 256,
    num_prefills: int = 3,
    num_bursts: int = 3,
    burst_tokens: int = 16,
    num_rounds: int = 1,
    dtype: str = "float32",
) -> dict:
    prompt_ids = text_prompt(Tokenizer.from_model_dir(model_dir), 0, prompt_tokens)
    samples = {name: ([], [], None) for name, _, _ in MODES}
    for _ in range(num_rounds):
        for name, tp_size, choice in MODES:
            prefill_s, tokens_per_s, token_ids = sample_mode(
                model_dir,
                tp_size,
                choice,
                prompt_ids,
                dtype=dtype,
                num_prefills=num_prefills,
                num_bursts=num_bursts,
                burst_tokens=burst_tokens,
            )
            samples[name][0].extend(prefill_s)
            samples[name][1].extend(tokens_per_s)
            samples[name] = (samples[name][0], samples[name][1], token_ids)
    modes = [
        {
            "mode": name,
            "prefill_s": median(prefill_s),
            "decode_tokens_per_s": median(tokens_per_s),
            "prefill_samples_s": prefill_s,
            "decode_samples_tokens_per_s": tokens_per_s,
            "token_ids": token_ids,
        }
        for name, (prefill_s, tokens_per_s, token_ids) in samples.items()
    ]
    gloo, shared, one = modes
    return {
        "model": model_dir,
        "dtype": dtype,
        "threads_per_rank": 1,
        "prompt_tokens": prompt_tokens,
        "rounds": num_rounds,
        "load_average": os.getloadavg()[0],
        "modes": modes,
        "ratios": {
            "decode_shared_memory_over_gloo": shared["decode_tokens_per_s"] / gloo["decode_tokens_per_s"],
            "prefill_gloo_over_shared_memory": gloo["prefill_s"] / shared["prefill_s"],
            "decode_tp2_shared_memory_over_tp1": shared["decode_tokens_per_s"] / one["decode_tokens_per_s"],
            "prefill_tp1_over_tp2_shared_memory": one["prefill_s"] / shared["prefill_s"],
        },
        "tokens_identical": all(mode["token_ids"] == one["token_ids"] for mode in modes),
    }


def print_report(report: dict) -> None:
    print_table(
        f"forward collectives, {report['dtype']}, 1 thread per rank, {report['prompt_tokens']}-token prompt, "
        f"{report['rounds']} round(s), load average {report['load_average']:.1f}",
        ("mode", "prefill s", "decode tok/s"),
        [(m["mode"], m["prefill_s"], m["decode_tokens_per_s"]) for m in report["modes"]],
    )
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.2f}x")
    print(f"tokens identical in every mode: {report['tokens_identical']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--prefills", type=int, default=3, help="timed prefills per mode and round")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per timed burst")
    parser.add_argument("--bursts", type=int, default=3, help="timed bursts per mode and round")
    parser.add_argument("--rounds", type=int, default=1, help="times every mode runs, in turn")
    args = parser.parse_args(argv)
    report = run_collectives(
        args.model or default_model_dir(),
        prompt_tokens=args.prompt_tokens,
        num_prefills=args.prefills,
        num_bursts=args.bursts,
        burst_tokens=args.tokens,
        num_rounds=args.rounds,
        dtype=args.dtype,
    )
    print_report(report)
    return finish(
        report, args.json, None if report["tokens_identical"] else "the modes decoded different tokens"
    )


if __name__ == "__main__":
    raise SystemExit(main())
