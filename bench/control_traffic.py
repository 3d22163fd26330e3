"""Control traffic on the wire group: messages and votes rank 0 sends per step and per request.

One two-rank engine (local_engine, the real lane host) serves `--streams` short chat prompts in two
bursts (the second arriving while the first decodes) and one long prompt in chunks among them;
rank 0's channel is watched, counting every broadcast by kind (the kinds inside a Bundle too) and
every vote. Reported: messages and votes per decode round, and the messages and votes beyond the
rounds' own per request served. The script reads only Channel.send and Channel.vote, so the very
same file measures an older tree (copy it there) for the before-and-after figures.

    python -m bench.control_traffic [--streams 16 --max-tokens 24] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
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
    print_table,
    text_prompt,
    watch_streams,
)
from tpserve.server.requests import GenerationRequest  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402
from tpserve.server.wiring import local_engine  # noqa: E402

DECODES = ("Round", "Verify", "Mixed")  # the kinds that carry a decode round


class WatchedChannel:
    """Rank 0's channel, counting what it sends (by kind) and the votes it takes."""

    def __init__(self, channel):
        self._channel = channel
        self.sent: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()  # message kinds, inside Bundles too
        self.votes = 0
        self.votes_per_message: list[int] = []  # votes taken after each message, before the next

    def send(self, msg) -> None:
        self.votes_per_message.append(0)
        self.sent[type(msg).__name__] += 1
        for inner in getattr(msg, "messages", (msg,)):
            self.kinds[type(inner).__name__] += 1
        self._channel.send(msg)

    def vote(self, ok: bool) -> bool:
        self.votes += 1
        self.votes_per_message[-1] += 1
        return self._channel.vote(ok)

    def __getattr__(self, name):
        return getattr(self._channel, name)


def run_traffic(
    model_dir: str, *, num_streams: int, max_tokens: int, dtype: str, step_tokens: int = 0
) -> dict:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    budget = {"step_tokens": step_tokens} if step_tokens else {}  # an older tree has no such setting
    settings = bench_settings(
        model_dir, dtype=dtype, tp_size=2, num_lanes=num_streams + 1, context_size=1024, **budget
    )
    long_prompt = text_prompt(tokenizer, 999, 3 * settings.max_prefill_tokens // 2)
    requests = [
        GenerationRequest(tuple(chat_prompt(tokenizer, i)), max_tokens, GREEDY) for i in range(num_streams)
    ]
    with local_engine(settings) as engine:
        watched = WatchedChannel(engine.leader.channel)
        engine.leader.channel = watched
        half = num_streams // 2
        first = [engine.host.submit(r) for r in requests[:half]]
        first[0].next_event(timeout=120)  # the first burst is decoding
        late = [engine.host.submit(GenerationRequest(tuple(long_prompt), max_tokens, GREEDY))]
        late += [engine.host.submit(r) for r in requests[half:]]
        records = watch_streams(first + late)
    num_requests = len(records)
    num_rounds = sum(watched.kinds[kind] for kind in DECODES)
    sent = sum(watched.sent.values())
    return {
        "model": model_dir,
        "streams": num_requests,
        "max_tokens": max_tokens,
        "messages_by_kind": dict(watched.sent),
        "kinds_carried": dict(watched.kinds),
        "messages": sent,
        "votes": watched.votes,
        "decode_rounds": num_rounds,
        "messages_per_round": sent / num_rounds,
        "votes_per_round": watched.votes / num_rounds,
        "most_votes_in_a_step": max(watched.votes_per_message, default=0),
        "extra_messages_per_request": (sent - num_rounds) / num_requests,
        "votes_per_request": watched.votes / num_requests,
        "completion_tokens": sum(len(r.token_ids) for r in records),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--streams", type=int, default=16, help="short chat requests, in two bursts")
    parser.add_argument("--max-tokens", type=int, default=24, help="each reply's length")
    parser.add_argument(
        "--step-tokens", type=int, default=0, help="the pass's token budget (0: the engine's default)"
    )
    args = parser.parse_args(argv)
    report = run_traffic(
        args.model or default_model_dir(),
        num_streams=args.streams,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        step_tokens=args.step_tokens,
    )
    print_table(
        f"control traffic: {report['streams']} requests (one long, in chunks), {report['decode_rounds']} decode rounds",
        (
            "messages",
            "votes",
            "messages / round",
            "votes / round",
            "most votes / step",
            "extra messages / request",
            "votes / request",
        ),
        [
            (
                report["messages"],
                report["votes"],
                report["messages_per_round"],
                report["votes_per_round"],
                report["most_votes_in_a_step"],
                report["extra_messages_per_request"],
                report["votes_per_request"],
            )
        ],
    )
    print(f"messages by kind: {report['messages_by_kind']}; carried: {report['kinds_carried']}")
    return finish(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
