"""Time to first token of an image chat and of an 8-frame video chat through the real daemon
(`tpserve serve --vision`, two ranks), beside a text chat of the same words.

The model is a tiny random Qwen2.5-VL written by transformers itself (tests/tiny_qwen_vl.py, as the
tests write it) unless --model names one; the images and videos are blocks of random colour made
with Pillow and PyAV (tests/tiny_llava.py, tests/tiny_video.py), a new seed every round, and the
daemon runs with --prefix-caching false, so every chat is prefilled cold. Each round sends a text chat, an image chat and
a video chat, one at a time over gRPC, each with a reply of one greedy token. Reported per kind:
the prompt's tokens, the median time from the call to the first token (client side: the media's
header, demux, decode, preprocessing and the vision tower on rank 0 included) and the engine's own
median time to first token (Usage.time_to_first_token_s, from admission: the prefill alone), and
the client median over the text chat's, measured in the same run.

    python -m bench.vision_ttft [--rounds 5] [--model DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:  # the tiny model and media builders the tests use
    sys.path.insert(0, str(ROOT / "tests"))

from tiny_llava import block_image  # noqa: E402
from tiny_qwen_vl import write_tiny_qwen_vl  # noqa: E402
from tiny_video import block_video  # noqa: E402

from bench.common import finish, median, print_table  # noqa: E402
from bench.front_gap import Daemon  # noqa: E402
from tpserve.v1 import serving_pb2, serving_pb2_grpc  # noqa: E402

CONTEXT = 1024
SIZE = (72, 72)  # pixels; the tiny model's 6-pixel patches merged 2x2: 36 positions an image
NUM_FRAMES, VIDEO_FPS = 8, 2  # 4 s at 2 fps: the fps policy (2 a second) samples all 8 frames
TEXT = "describe what you see in as few words as you can"
CALL_TIMEOUT_S = 300.0
KINDS = ("text", "image", "video")


def chat(kind: str, seed: int) -> serving_pb2.GenerateRequest:
    request = serving_pb2.GenerateRequest(max_tokens=1, ignore_eos=True)
    message = request.messages.add(role="user")
    if kind == "image":
        message.parts.add(media=serving_pb2.Media(mime_type="image/png", data=block_image(seed, SIZE)))
    elif kind == "video":
        video = block_video(seed, NUM_FRAMES, SIZE, fps=VIDEO_FPS)
        message.parts.add(media=serving_pb2.Media(mime_type="video/mp4", data=video))
    message.parts.add(text=TEXT)
    return request


def first_token(stub, request) -> dict:
    """One chat's client-side time to first token, the engine's, and its prompt's size."""
    started = time.perf_counter()
    first_s, usage = None, None
    for response in stub.Generate(request, timeout=CALL_TIMEOUT_S):
        if response.token_ids and first_s is None:
            first_s = time.perf_counter() - started
        if response.finish_reason:
            usage = response.usage
    if first_s is None or usage is None or usage.cached_tokens:
        raise RuntimeError(f"a chat gave no first token, or hit the cache: {usage}")
    return {
        "client_s": first_s,
        "engine_s": usage.time_to_first_token_s,
        "prompt_tokens": usage.prompt_tokens,
    }


def measure(daemon: Daemon, num_rounds: int) -> dict[str, list[dict]]:
    stub = serving_pb2_grpc.ServingStub(daemon.channel)
    first_token(stub, chat("video", 10_000))  # warm: the first call of each path loads code
    first_token(stub, chat("image", 10_000))
    samples: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for round_index in range(num_rounds):  # the kinds interleaved, so drift touches each alike
        for kind in KINDS:
            samples[kind].append(first_token(stub, chat(kind, round_index)))
    return samples


def summary(samples: dict[str, list[dict]]) -> dict[str, dict]:
    text_s = median([s["client_s"] for s in samples["text"]])
    rows = {}
    for kind, runs in samples.items():
        client_s = median([s["client_s"] for s in runs])
        rows[kind] = {
            "prompt_tokens": runs[0]["prompt_tokens"],
            "ttft_median_ms": client_s * 1000,
            "engine_ttft_median_ms": median([s["engine_s"] for s in runs]) * 1000,
            "over_text": client_s / text_s,
        }
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="a Qwen2.5-VL directory (default: a tiny one written here)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="chats of each kind")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE")
    parser.add_argument("--log", default="/tmp/vision_ttft.log", help="where the daemon's log goes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vision-ttft-") as scratch:
        model_dir = args.model or str(write_tiny_qwen_vl(Path(scratch) / "tiny-qwen-vl"))
        daemon = Daemon(model_dir, CONTEXT, False, Path(args.log), ("--vision", "--prefix-caching", "false"))
        try:
            daemon.wait_serving()
            samples = measure(daemon, args.rounds)
        finally:
            daemon.stop()
    rows = summary(samples)
    print_table(
        f"time to first token through the daemon (2 ranks), median of {args.rounds}",
        ["chat", "prompt tokens", "ttft ms", "engine ttft ms", "x text"],
        [
            [kind, str(r["prompt_tokens"]), f"{r['ttft_median_ms']:.1f}", f"{r['engine_ttft_median_ms']:.1f}"]
            + [f"{r['over_text']:.2f}"]
            for kind, r in rows.items()
        ],
    )
    report = {
        "model": args.model or "tiny Qwen2.5-VL (tests/tiny_qwen_vl.py)",
        "media": {"size": SIZE, "video_frames": NUM_FRAMES, "video_fps": VIDEO_FPS},
        "kinds": rows,
        "samples": samples,
    }
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
