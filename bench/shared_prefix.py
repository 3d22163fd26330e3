"""Sixteen chats with one ~1,000-token system prompt through the real daemon: KV blocks held against
the blocks sixteen unshared copies would need, and each chat's time to first token.

Starts the real daemon (`tpserve serve`, two ranks, configs/default.yaml, the shipped default model
unless --model; `--flags` adds serve flags) and sends greedy chats over HTTP
(/v1/chat/completions, streamed, with usage), each with the same system prompt of at least
`--system-tokens` tokens and a user message of its own. Three bursts, each with a system prompt of
its own so nothing is cached before it:

- together: all sixteen at once. One chat computes the system prompt's blocks; the other fifteen
  wait for them (they share them rather than compute copies) and prefill only what follows them.
  Their first tokens cannot come before the prompt is computed, so their time from sending is
  about the first's; what sharing saves shows in how little comes after it.
- after the first: one chat alone, then the other fifteen at once as soon as its first token
  came (it is still answering). Each of the fifteen computes only what follows the shared blocks,
  all of them in as few passes as the step's prompt budget allows (max_prefill_tokens); target:
  their first tokens at most 0.2x the first's time.
- one by one: each chat sent as soon as the one before it got its first token (all still
  answering): each first token costs one pass over that chat's own tokens beside the others' decoding.

Reported per burst: each chat's time to first token (from its request's sending), the usage's
`prompt_tokens_details.cached_tokens`, and the peak of the daemon's `tpserve_kv_blocks_used`
(polled from /metrics during the burst) against the blocks sixteen unshared copies would need
(each chat's prompt and reply in whole blocks, summed).

    python -m bench.shared_prefix [--system-tokens 1000 --max-tokens 32] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import FILLER, default_model_dir, finish, median, print_table  # noqa: E402
from bench.peer_servers import REPO, Server, health_ready, streamed_chunks  # noqa: E402
from tpserve.ranks.local_ranks import free_port  # noqa: E402
from tpserve.server.kv_blocks import blocks_for  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402

NUM_CHATS = 16
TARGET = 0.2  # the later chats' first tokens against the first's time
POLL_S = 0.05
REQUEST_TIMEOUT_S = 900.0
TOPICS = ("rivers", "bridges", "libraries", "volcanoes", "gardens", "trains", "comets", "bees")


@dataclass
class Chat:
    """One chat's request and what came back."""

    index: int
    sent: float = 0.0
    first: float = 0.0  # the first token's arrival (time.perf_counter)
    end: float = 0.0
    text: str = ""
    usage: dict = field(default_factory=dict)

    @property
    def ttft_s(self) -> float:
        return self.first - self.sent

    @property
    def cached_tokens(self) -> int:
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def system_prompt(tokenizer: Tokenizer, name: str, num_tokens: int) -> str:
    """A system prompt of at least `num_tokens` tokens, its first line naming it (one burst's own)."""
    text = f"You are assistant {name}. Keep these notes in mind."
    while len(tokenizer.encode(text)) < num_tokens:
        text += f" Note {text.count('Note') + 1}: {FILLER}."
    return text


def user_message(index: int) -> str:
    return f"Question {index}: tell me one thing about {TOPICS[index % len(TOPICS)]}."


def send_chat(http_port: int, system: str, chat: Chat, max_tokens: int, on_first=None) -> Chat:
    """One streamed greedy chat; `on_first()` runs once its first token arrives."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user_message(chat.index)}]
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    # Usage in every chunk: the first token is the first chunk counting one, whatever its text (a
    # token may end inside a character, and its text come with the next).
    body |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chat.sent = time.perf_counter()
    for chunk in streamed_chunks(http_port, "/v1/chat/completions", body, REQUEST_TIMEOUT_S):
        text = "".join(
            (choice.get("delta") or {}).get("content") or "" for choice in chunk.get("choices", ())
        )
        if (chunk.get("usage") or {}).get("completion_tokens") and not chat.first:
            chat.first = time.perf_counter()
            if on_first is not None:
                on_first()
        chat.text += text
        if chunk.get("usage"):
            chat.usage = chunk["usage"]
    chat.end = time.perf_counter()
    return chat


class BlocksPoll:
    """Reads `tpserve_kv_blocks_used` from the metrics page every POLL_S on its own thread; keeps the peak."""

    def __init__(self, metrics_port: int):
        self._url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.peak = 0
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> dict[str, float]:
        with urllib.request.urlopen(self._url, timeout=10) as page:
            text = page.read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, int(self.read()["tpserve_kv_blocks_used"]))
            self.num_samples += 1
            self._stop.wait(POLL_S)

    def __enter__(self) -> BlocksPoll:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


def wait_first_token(future, came: threading.Event) -> None:
    """Until the chat's first token came; its failure, or a chat that ended without one, is raised."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while not came.wait(0.05):
        if future.done():
            chat = future.result()  # raises the chat's failure
            raise RuntimeError(f"chat {chat.index} ended without a token: {chat.usage}")
        if time.monotonic() > deadline:
            raise RuntimeError("a chat got no token")


def run_together(http_port: int, system: str, max_tokens: int) -> list[Chat]:
    """All sixteen chats at once."""
    chats = [Chat(index) for index in range(NUM_CHATS)]
    with ThreadPoolExecutor(NUM_CHATS) as pool:
        return list(pool.map(lambda chat: send_chat(http_port, system, chat, max_tokens), chats))


def run_after_first(http_port: int, system: str, max_tokens: int) -> list[Chat]:
    """One chat alone, then the other fifteen at once as soon as its first token came. The first
    answers four times as long, so it is still decoding while the fifteen come in."""
    chats = [Chat(index) for index in range(NUM_CHATS)]
    first_came = threading.Event()
    with ThreadPoolExecutor(NUM_CHATS) as pool:
        first = pool.submit(send_chat, http_port, system, chats[0], 4 * max_tokens, first_came.set)
        wait_first_token(first, first_came)
        rest = list(pool.map(lambda chat: send_chat(http_port, system, chat, max_tokens), chats[1:]))
        return [first.result(), *rest]


def run_one_by_one(http_port: int, system: str, max_tokens: int) -> list[Chat]:
    """Each chat sent as soon as the one before it got its first token; all answer four times as
    long, so every one is still decoding when the last comes in."""
    chats = [Chat(index) for index in range(NUM_CHATS)]
    with ThreadPoolExecutor(NUM_CHATS) as pool:
        futures = []
        for chat in chats:
            came = threading.Event()
            futures.append(pool.submit(send_chat, http_port, system, chat, 4 * max_tokens, came.set))
            wait_first_token(futures[-1], came)
        return [future.result() for future in futures]


def burst_report(name: str, chats: list[Chat], peak_blocks: int, block_size: int) -> dict:
    """The figures of one burst: the first = the chat that computed the system prompt (no cached tokens)."""
    cold = [chat for chat in chats if chat.cached_tokens == 0]
    first = min(cold, key=lambda chat: chat.sent) if cold else chats[0]
    others = [chat for chat in chats if chat is not first]
    lengths = [chat.usage["prompt_tokens"] + chat.usage["completion_tokens"] for chat in chats]
    unshared = sum(blocks_for(length, block_size) for length in lengths)
    # Sharing at its best: one copy of the shared blocks (the first chat's), each chat's own past them.
    shared = max(chat.cached_tokens for chat in chats) // block_size
    ideal = shared + sum(blocks_for(length, block_size) - shared for length in lengths)
    ttfts = [chat.ttft_s for chat in others]
    after_first = max(chat.first - first.first for chat in others)
    return {
        "burst": name,
        "first_ttft_s": first.ttft_s,
        "others_ttft_median_s": median(ttfts),
        "others_ttft_max_s": max(ttfts),
        "ratio_median": median(ttfts) / first.ttft_s,
        "ratio_max": max(ttfts) / first.ttft_s,
        # the last of the others' first tokens after the first's (negative: all came before it)
        "others_after_first_max_s": after_first,
        "ratio_after_first": after_first / first.ttft_s,
        # prompt tokens the others computed, each its own past the shared blocks
        "others_computed_tokens": [chat.usage["prompt_tokens"] - chat.cached_tokens for chat in others],
        "num_cold": len(cold),
        "first_cached_tokens": first.cached_tokens,
        "first_prompt_tokens": first.usage["prompt_tokens"],
        "others_cached_tokens": [chat.cached_tokens for chat in others],
        "prompt_tokens": [chat.usage["prompt_tokens"] for chat in chats],
        "peak_blocks_used": peak_blocks,
        "unshared_blocks": unshared,
        "ideal_shared_blocks": ideal,
        "shared_prefix_blocks": shared,
        "chats": [
            {
                "index": c.index,
                "ttft_s": c.ttft_s,
                "total_s": c.end - c.sent,
                "usage": c.usage,
                "text": c.text,
            }
            for c in chats
        ],
    }


BURSTS = (("together", run_together), ("after the first", run_after_first), ("one by one", run_one_by_one))


def run_bench(model_dir: str, *, system_tokens: int, max_tokens: int, flags: Sequence[str] = ()) -> dict:
    tokenizer = Tokenizer.from_model_dir(model_dir)
    http_port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "tpserve.cli", "serve", "--config", str(REPO / "configs/default.yaml")]
    argv += ["--model", model_dir, "--port", str(free_port()), "--http-port", str(http_port)]
    argv += ["--metrics-port", str(metrics_port), *flags]
    poll = BlocksPoll(metrics_port)
    http_ready = health_ready(http_port)

    def ready() -> bool:  # the HTTP API answers a moment before the metrics page does
        try:
            return http_ready() and bool(poll.read())
        except OSError:
            return False

    server = Server("shared-prefix", argv, ready, generate=None)
    try:
        block_size = int(poll.read()["tpserve_kv_block_size"])
        bursts = []
        for name, run in BURSTS:
            system = system_prompt(tokenizer, name, system_tokens)
            with BlocksPoll(metrics_port) as poll:
                chats = run(http_port, system, max_tokens)
            bursts.append(burst_report(name, chats, poll.peak, block_size))
    finally:
        server.close()
    return {
        "model": model_dir,
        "flags": list(flags),
        "system_tokens": system_tokens,
        "max_tokens": max_tokens,
        "num_chats": NUM_CHATS,
        "block_size": block_size,
        "load_average": os.getloadavg()[0],
        "target_ratio": TARGET,
        "bursts": bursts,
        "log": server.log.name,
    }


def print_report(report: dict) -> None:
    prompt_tokens = report["bursts"][0]["prompt_tokens"]
    print_table(
        f"{report['num_chats']} chats, one system prompt of >= {report['system_tokens']} tokens "
        f"(prompts {min(prompt_tokens)}..{max(prompt_tokens)} tokens), {report['max_tokens']}-token "
        f"replies, blocks of {report['block_size']}, load average {report['load_average']:.1f}",
        (
            "burst",
            "blocks used",
            "unshared",
            "used/unshared",
            "1st ttft s",
            "2nd..16th median s",
            "max s",
            "median/1st",
            "max/1st",
            "cached (2nd..16th)",
        ),
        [
            (
                burst["burst"],
                burst["peak_blocks_used"],
                burst["unshared_blocks"],
                burst["peak_blocks_used"] / burst["unshared_blocks"],
                burst["first_ttft_s"],
                burst["others_ttft_median_s"],
                burst["others_ttft_max_s"],
                burst["ratio_median"],
                burst["ratio_max"],
                f"{min(burst['others_cached_tokens'])}..{max(burst['others_cached_tokens'])}",
            )
            for burst in report["bursts"]
        ],
    )
    for burst in report["bursts"]:
        print(
            f"{burst['burst']}: {burst['num_cold']} chat(s) computed the system prompt; all {len(burst['chats'])} "
            f"at full length hold {burst['ideal_shared_blocks']} blocks with one copy of the "
            f"{burst['shared_prefix_blocks']} shared, {burst['unshared_blocks']} without sharing; "
            f"the 15 computed {sum(burst['others_computed_tokens'])} prompt tokens "
            f"({min(burst['others_computed_tokens'])}..{max(burst['others_computed_tokens'])} each, against the "
            f"first's {burst['first_prompt_tokens']}); the last of them came "
            f"{burst['others_after_first_max_s']:.3f} s after the first's first token "
            f"({burst['ratio_after_first']:.3f}x the first's time)"
        )
    for burst in report["bursts"][1:]:
        print(f"{burst['burst']}: max/1st {burst['ratio_max']:.3f} (target <= {TARGET})")


def failure_of(report: dict) -> str | None:
    """Sharing that did not happen fails the run; a missed time target is reported, not failed."""
    for burst in report["bursts"]:
        if burst["num_cold"] != 1 or min(burst["others_cached_tokens"]) == 0:
            return f"{burst['burst']}: {burst['num_cold']} chats computed the system prompt, not 1"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the prepared default model)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE")
    parser.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt, at least")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="each reply's length (the first's x4 after it)"
    )
    parser.add_argument("--flags", default="", help="further serve flags, e.g. '--kv-block-size 16'")
    args = parser.parse_args(argv)
    report = run_bench(
        args.model or default_model_dir(),
        system_tokens=args.system_tokens,
        max_tokens=args.max_tokens,
        flags=args.flags.split(),
    )
    print_report(report)
    return finish(report, args.json, failure_of(report))


if __name__ == "__main__":
    raise SystemExit(main())
