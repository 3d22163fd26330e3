"""Control traffic on the wire group: messages and votes rank 0 sends per scheduling step and per request.

One two-rank engine (local_engine, the real lane host) serves `--streams` short chat prompts in two
bursts (the second arriving while the first decodes) and one long prompt in chunks among them,
then `--alone` more one at a time, each after an idle spell (as sporadic traffic comes); rank 0's channel is watched, counting every broadcast by kind (the parts of a StepPlan too) and
every vote, and the lane host's on_step marks where each scheduling step ends. A step here is a
scheduling step that sent a pass (a StepPlan carrying a Prefill, a Round or a Verify; an older tree's
Prefill, Round, Verify or Mixed, alone or in a Bundle);
what goes between steps (Idle before an idle spell, with the lanes closed just before it in a
plan with no pass of their own, and Stop at the end) is counted apart. Reported: messages and votes per step,
the most in one step, the steps with no decode round (prompts alone), the messages beyond one a
step per request served, and the messages per idle spell (Stop and what goes with it aside). `--steps` prints each step's messages. The script reads only Channel.send,
Channel.vote and local_engine's on_step, so the very same file measures an older tree (copy it
there, with local_engine's on_step) for the before-and-after figures.

    python -m bench.control_traffic [--streams 16 --max-tokens 24 --alone 4] [--steps] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
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

PASSES = ("Prefill", "Round", "Verify", "Mixed")  # the kinds that run a forward pass (Mixed: an older tree's)
DECODES = ("Round", "Verify", "Mixed")  # the passes that carry a decode round
IDLE_WAIT_S = 60.0  # the longest wait for the lane host to go idle between lone requests


class WatchedChannel:
    """Rank 0's channel, counting what it sends (by kind) and the votes it takes, in the lane
    host's steps (`step_done` closes one)."""

    def __init__(self, channel):
        self._channel = channel
        self.sent: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()  # message kinds, a StepPlan's parts too
        self.votes = 0
        self.steps: list[list[tuple[str, int]]] = [[]]  # per step: (what was sent, votes after it)

    def send(self, msg) -> None:
        self.sent[type(msg).__name__] += 1
        # A StepPlan's parts (an older tree's Bundle's messages), in the order they are applied.
        inner = getattr(msg, "parts", None) or getattr(msg, "messages", (msg,))
        for each in inner:
            self.kinds[type(each).__name__] += 1
        self.steps[-1].append(("+".join(type(each).__name__ for each in inner), 0))
        self._channel.send(msg)

    def vote(self, ok: bool) -> bool:
        self.votes += 1
        what, votes = self.steps[-1][-1]
        self.steps[-1][-1] = (what, votes + 1)
        return self._channel.vote(ok)

    def wait_for_idle(self) -> None:
        """Until the last message sent is Idle: the lane host ran out of work."""
        deadline = time.monotonic() + IDLE_WAIT_S
        while not (self.steps[-1] and self.steps[-1][-1][0] == "Idle"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 sent no Idle within {IDLE_WAIT_S:.0f} s")
            time.sleep(0.005)

    def step_done(self) -> None:
        """The lane host's on_step: what is sent from now on belongs to the next step."""
        if self.steps[-1]:
            self.steps.append([])

    def __getattr__(self, name):
        return getattr(self._channel, name)


def runs_pass(what: str) -> bool:
    """Whether a message (its kinds joined by "+": a StepPlan's parts, an older tree's Bundle's)
    runs a forward pass."""
    return any(kind in PASSES for kind in what.split("+"))


def decodes(what: str) -> bool:
    """Whether a message (as runs_pass reads it) carries a decode round."""
    return any(kind in DECODES for kind in what.split("+"))


def idle_messages(between: list[str]) -> int:
    """The messages of idle spells: those between steps but Stop and the lanes sent just before it."""
    kept = [what for what in between if what != "Stop"]
    if between and between[-1] == "Stop" and len(between) > 1 and between[-2] != "Idle":
        kept = kept[:-1]  # the lanes closed since the last pass, sent before Stop
    return len(kept)


def run_traffic(
    model_dir: str, *, num_streams: int, max_tokens: int, dtype: str, step_tokens: int = 0, num_alone: int = 4
) -> dict:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    budget = {"step_tokens": step_tokens} if step_tokens else {}  # an older tree has no such setting
    settings = bench_settings(
        model_dir, dtype=dtype, tp_size=2, num_lanes=num_streams + 1, context_size=1024, **budget
    )
    long_prompt = text_prompt(tokenizer, 999, 3 * settings.max_prefill_tokens // 2)
    requests = [
        GenerationRequest(tuple(chat_prompt(tokenizer, i)), max_tokens, GREEDY)
        for i in range(num_streams + num_alone)
    ]
    watched: WatchedChannel | None = None

    def step_done() -> None:
        if watched is not None:
            watched.step_done()

    with local_engine(settings, on_step=step_done) as engine:
        watched = WatchedChannel(engine.leader.channel)
        engine.leader.channel = watched
        half = num_streams // 2
        first = [engine.host.submit(r) for r in requests[:half]]
        first[0].next_event(timeout=120)  # the first burst is decoding
        late = [engine.host.submit(GenerationRequest(tuple(long_prompt), max_tokens, GREEDY))]
        late += [engine.host.submit(r) for r in requests[half:num_streams]]
        records = watch_streams(first + late)
        for each in requests[num_streams:]:  # one at a time, each after an idle spell
            watched.wait_for_idle()
            records += watch_streams([engine.host.submit(each)])
        watched.wait_for_idle()
    num_requests = len(records)
    # Idle, Stop and the lanes closed just before them (a plan with no pass) go between steps,
    # wherever an idle spell falls (Idle is sent after a step's on_step, so it opens the next one).
    between = [sent for step in watched.steps for sent in step if not runs_pass(sent[0])]
    steps = [[sent for sent in step if runs_pass(sent[0])] for step in watched.steps]
    steps = [step for step in steps if step]
    in_steps = sum(len(step) for step in steps)
    num_rounds = sum(watched.kinds[kind] for kind in DECODES)
    alone = [step for step in steps if not any(decodes(what) for what, _ in step)]
    num_idles = watched.kinds["Idle"]
    return {
        "model": model_dir,
        "streams": num_requests,
        "max_tokens": max_tokens,
        "messages_by_kind": dict(watched.sent),
        "kinds_carried": dict(watched.kinds),
        "messages": sum(watched.sent.values()),
        "votes": watched.votes,
        "steps": len(steps),
        "decode_rounds": num_rounds,
        "prompt_only_steps": len(alone),
        "messages_in_steps": in_steps,
        "messages_between_steps": len(between),
        "messages_per_step": in_steps / len(steps),
        "most_messages_in_a_step": max((len(step) for step in steps), default=0),
        "votes_per_step": watched.votes / len(steps),
        "most_votes_in_a_step": max((sum(v for _, v in step) for step in steps), default=0),
        "extra_messages_per_request": (in_steps - len(steps)) / num_requests,
        "votes_per_request": watched.votes / num_requests,
        "idle_spells": num_idles,
        "messages_per_idle_spell": idle_messages([what for what, _ in between]) / max(1, num_idles),
        "completion_tokens": sum(len(r.token_ids) for r in records),
        "step_messages": [[what for what, _ in step] for step in steps],
        "between_steps": [what for what, _ in between],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--streams", type=int, default=16, help="short chat requests, in two bursts")
    parser.add_argument("--max-tokens", type=int, default=24, help="each reply's length")
    parser.add_argument(
        "--step-tokens", type=int, default=0, help="the pass's token budget (0: the engine's default)"
    )
    parser.add_argument("--alone", type=int, default=4, help="requests then served one at a time")
    parser.add_argument("--steps", action="store_true", help="print each step's messages")
    args = parser.parse_args(argv)
    report = run_traffic(
        args.model or default_model_dir(),
        num_streams=args.streams,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        step_tokens=args.step_tokens,
        num_alone=args.alone,
    )
    if args.steps:
        for index, step in enumerate(report["step_messages"]):
            print(f"step {index}: {', '.join(step)}")
    print_table(
        f"control traffic: {report['streams']} requests (one long, in chunks; {args.alone} one at a time), "
        f"{report['steps']} steps "
        f"({report['decode_rounds']} decode rounds, {report['prompt_only_steps']} with prompts alone)",
        (
            "messages in steps",
            "messages / step",
            "most messages / step",
            "votes / step",
            "most votes / step",
            "extra messages / request",
            "votes / request",
            "messages / idle spell",
        ),
        [
            (
                report["messages_in_steps"],
                report["messages_per_step"],
                report["most_messages_in_a_step"],
                report["votes_per_step"],
                report["most_votes_in_a_step"],
                report["extra_messages_per_request"],
                report["votes_per_request"],
                report["messages_per_idle_spell"],
            )
        ],
    )
    print(f"messages by kind: {report['messages_by_kind']}; carried: {report['kinds_carried']}")
    print(f"between steps (idle, stop): {report['between_steps']}")
    return finish(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
