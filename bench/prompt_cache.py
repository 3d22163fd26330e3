"""A chat's second turn with prefix caching on versus off: time to its first token.

Each round is a new conversation: a first turn whose prompt (a system line and a long first message)
runs to about `--history-tokens` tokens, then a second turn that repeats that history, the first
turn's reply and a short new message. With prefix caching on, the first turn's full KV blocks stay
cached and the second turn's table starts with them, prefilling only what follows; with it off
(prefix_caching false) the second turn prefills everything. Both modes run in one invocation on two
ranks through the real lane host, one engine per mode, on the same conversations. Reported per mode:
the second turn's time to first token (target: on / off at most 0.3), the first turn's (cold in both
modes, for scale), and the prompt tokens the cache supplied. Every reply must be identical between
the modes (even rounds greedy, odd rounds sampled with a seed); the run exits 1 otherwise.

    python -m bench.prompt_cache [--history-tokens 1000 --rounds 2] [--json FILE]
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
    FILLER,
    GREEDY,
    StreamRecord,
    add_common_args,
    bench_settings,
    default_model_dir,
    finish,
    median,
    print_table,
    watch_streams,
)
from tpserve.kernels.sampling_params import SamplingParams  # noqa: E402
from tpserve.server.requests import GenerationRequest  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402
from tpserve.server.wiring import LocalEngine, local_engine  # noqa: E402

MODES = (False, True)  # the cache off first: a cold machine favours neither side
SECOND_QUESTION = "Thanks. Summarise that in one sentence, then tell me what to read next."


def first_turn_messages(tokenizer: Tokenizer, index: int, history_tokens: int) -> list[dict[str, str]]:
    """A system line naming the conversation, then notes pasted into the first message until the
    first turn's prompt holds at least `history_tokens` tokens."""
    system = f"{index}: a new conversation. You are a helpful assistant; answer briefly."
    notes = "Here are my notes on how the server works."
    while True:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": notes}]
        if len(tokenizer.encode_chat(messages)) >= history_tokens:
            return messages
        notes += f" Note {notes.count('Note') + 1}: {FILLER}."


def sampling_of(index: int) -> SamplingParams:
    return GREEDY if index % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.95, seed=index)


def run_turn(
    engine: LocalEngine, messages, tokenizer: Tokenizer, max_tokens: int, sampling, ignore_eos: bool
):
    prompt = tuple(tokenizer.encode_chat(messages))
    request = GenerationRequest(prompt, max_tokens, sampling, ignore_eos=ignore_eos)
    (record,) = watch_streams([engine.host.submit(request)])
    return prompt, record


def run_conversation(
    engine: LocalEngine, tokenizer: Tokenizer, index: int, history_tokens: int, max_tokens: int
) -> dict:
    """Both turns of one conversation, one after the other, each alone on the engine."""
    messages = first_turn_messages(tokenizer, index, history_tokens)
    sampling = sampling_of(index)
    # The first reply may end at EOS, as a user's would: its text becomes part of the history.
    first_prompt, first = run_turn(engine, messages, tokenizer, max_tokens, sampling, ignore_eos=False)
    messages += [
        {"role": "assistant", "content": tokenizer.decode(first.token_ids)},
        {"role": "user", "content": SECOND_QUESTION},
    ]
    second_prompt, second = run_turn(engine, messages, tokenizer, max_tokens, sampling, ignore_eos=True)
    return {
        "first_prompt_tokens": len(first_prompt),
        "second_prompt_tokens": len(second_prompt),
        "first_first_token_s": first_token_s(first),
        "second_first_token_s": first_token_s(second),
        "second_cached_tokens": second.finished.usage.cached_tokens,
        "first_reply": first.token_ids,
        "second_reply": second.token_ids,
    }


def first_token_s(record: StreamRecord) -> float:
    return record.finished.usage.time_to_first_token_s


def run_mode(
    model_dir: str,
    tokenizer: Tokenizer,
    *,
    prefix_caching: bool,
    history_tokens: int,
    max_tokens: int,
    num_rounds: int,
    dtype: str,
) -> dict:
    # The longest history, the first reply re-encoded (with room to spare), the new message and its
    # turn markers, the second reply.
    longest = max(
        len(tokenizer.encode_chat(first_turn_messages(tokenizer, i, history_tokens)))
        for i in range(num_rounds)
    )
    needed = longest + 8 * max_tokens + len(tokenizer.encode(SECOND_QUESTION)) + 32
    settings = bench_settings(
        model_dir,
        dtype=dtype,
        tp_size=2,
        num_lanes=2,
        context_size=64 * -(-needed // 64),
        prefix_caching=prefix_caching,
    )
    with local_engine(settings) as engine:
        rounds = [
            run_conversation(engine, tokenizer, index, history_tokens, max_tokens)
            for index in range(num_rounds)
        ]
        stats = engine.host.block_stats()
    return {
        "prefix_caching": prefix_caching,
        "max_prefill_tokens": settings.max_prefill_tokens,
        "second_first_token_s": median([r["second_first_token_s"] for r in rounds]),
        "first_first_token_s": median([r["first_first_token_s"] for r in rounds]),
        "second_cached_tokens": median([r["second_cached_tokens"] for r in rounds]),
        "cache_hits": stats.hits,
        "cache_evictions": stats.evictions,
        "rounds": rounds,
    }


def run_prompt_cache(
    model_dir: str,
    *,
    history_tokens: int = 1000,
    max_tokens: int = 16,
    num_rounds: int = 2,
    dtype: str = "float32",
) -> dict:
    """Both modes, one after the other, on the same conversations."""
    tokenizer = Tokenizer.from_model_dir(model_dir)
    off, on = (
        run_mode(
            model_dir,
            tokenizer,
            prefix_caching=mode,
            history_tokens=history_tokens,
            max_tokens=max_tokens,
            num_rounds=num_rounds,
            dtype=dtype,
        )
        for mode in MODES
    )
    differing = [
        index
        for index, (a, b) in enumerate(zip(off["rounds"], on["rounds"]))
        if (a["first_reply"], a["second_reply"]) != (b["first_reply"], b["second_reply"])
    ]
    return {
        "model": model_dir,
        "dtype": dtype,
        "tp_size": 2,
        "threads_per_rank": 1,
        "history_tokens": history_tokens,
        "max_tokens": max_tokens,
        "num_rounds": num_rounds,
        "load_average": os.getloadavg()[0],
        "modes": [off, on],
        "second_first_token_ratio": on["second_first_token_s"] / off["second_first_token_s"],
        "replies_identical": not differing,
        "differing_rounds": differing,
    }


def print_report(report: dict) -> None:
    off, on = report["modes"]
    prompt_tokens = off["rounds"][0]["second_prompt_tokens"]
    print_table(
        f"chat second turn ({prompt_tokens}-token prompt, history of >= {report['history_tokens']}), "
        f"{report['num_rounds']} conversation(s), 2 ranks, {report['dtype']}, 1 thread per rank, "
        f"load average {report['load_average']:.1f}",
        ("cache", "2nd turn first token s", "1st turn first token s", "cached tokens", "hits", "evictions"),
        [
            (
                "on" if mode["prefix_caching"] else "off",
                mode["second_first_token_s"],
                mode["first_first_token_s"],
                mode["second_cached_tokens"],
                mode["cache_hits"],
                mode["cache_evictions"],
            )
            for mode in report["modes"]
        ],
    )
    print(f"second turn first token, on / off: {report['second_first_token_ratio']:.3f} (target <= 0.3)")
    print(f"replies identical between the modes: {report['replies_identical']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--history-tokens", type=int, default=1000, help="the first turn's prompt, at least")
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="each reply's length, compared between modes"
    )
    parser.add_argument("--rounds", type=int, default=2, help="conversations per mode (medians are reported)")
    args = parser.parse_args(argv)
    if args.history_tokens < 32 or args.rounds < 1:
        parser.error("need --history-tokens >= 32 and --rounds >= 1")
    report = run_prompt_cache(
        args.model or default_model_dir(),
        history_tokens=args.history_tokens,
        max_tokens=args.max_tokens,
        num_rounds=args.rounds,
        dtype=args.dtype,
    )
    print_report(report)
    failure = f"conversations {report['differing_rounds']} replied differently with the cache"
    return finish(report, args.json, None if report["replies_identical"] else failure)


if __name__ == "__main__":
    raise SystemExit(main())
