"""Quality of each weight format against float32: perplexity on a fixed text and greedy agreement.

Every format is loaded at tp=1 in this process (tp=2 gives the same logits bit for bit). Perplexity
is over `--text` (default: the GPL-3 text Debian ships, ~8,000 tokens) in windows of `--window`
tokens, each a fresh context whose second half is scored (as llama.cpp's llama-perplexity does, so
its figure on the GGUF compares: `llama-perplexity -m FILE.gguf -f TEXT -c 512`); agreement is the share of the first `--tokens` greedy tokens
that a format's reply has in common with float32's (up to its first different token) on chat prompts.

A format FORMAT/float16 keeps the KV pool in float16 (kv_dtype auto's choice where the C attention
kernel serves); every other runs over a float32 pool.

    python -m bench.quality [--formats none int4 int4/float16] [--text FILE] [--max-text-tokens 4096] [--json FILE]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import add_common_args, chat_prompt, default_model_dir, finish, print_table  # noqa: E402
from tpserve.kernels.linear import ROW_TILE  # noqa: E402
from tpserve.ranks.engine import Engine, open_lane
from tpserve.ranks.kv_store import KVPool  # noqa: E402
from tpserve.ranks.loader import load_rank_model  # noqa: E402
from tpserve.ranks.settings import QUANTIZE_CHOICES  # noqa: E402
from tpserve.server.tokenizer import Tokenizer  # noqa: E402

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


def load(model_dir: str, served: str, context: int) -> Engine:
    """served: a weight format, or FORMAT/KV with the KV pool's dtype (float32 unless named)."""
    quantize, _, kv_dtype = served.partition("/")
    model = load_rank_model(
        model_dir,
        tp_rank=0,
        tp_size=1,
        dtype=torch.float32,
        max_positions=context,
        row_tile=ROW_TILE,
        quantize=quantize,
    )
    kv_type = getattr(torch, kv_dtype or "float32")
    kv = KVPool(
        model.config.num_layers, 2 * context, model.kv_heads_per_piece(), model.config.head_dim, kv_type
    )
    return Engine(model, kv)


def perplexity(engine: Engine, ids: list[int], window: int) -> float:
    """Over consecutive windows of `window` tokens, each a fresh context, scoring the second half of
    each (its first half is context): llama.cpp's llama-perplexity counts the same way."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start : start + window]
        open_lane(engine, 0, window)
        logits = engine.forward([(0, 0, tuple(chunk[:-1]))], every_row=True)
        engine.release(0)
        first = window // 2
        scored = torch.tensor(chunk[first:])
        nll += F.cross_entropy(logits[first - 1 :], scored, reduction="sum").item()
        count += len(scored)
    return math.exp(nll / count)


def greedy(engine: Engine, prompt: list[int], num_tokens: int) -> list[int]:
    open_lane(engine, 0, len(prompt) + num_tokens)
    logits = engine.forward([(0, 0, tuple(prompt))])
    out = []
    for _ in range(num_tokens):
        token = int(logits[0].argmax())
        out.append(token)
        logits = engine.forward([(0, len(prompt) + len(out) - 1, (token,))])
    engine.release(0)
    return out


def agreement(reference: list[int], other: list[int]) -> int:
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return len(reference)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    formats = [q for q in QUANTIZE_CHOICES if q != "auto"]
    # FORMAT/float16: that format over a float16 KV pool (the shipped kv_dtype on a CPU: auto)
    served = [*formats, *(f"{q}/float16" for q in formats)]
    parser.add_argument("--formats", nargs="+", default=[*formats, "int4/float16"], choices=served)
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--max-text-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    add_common_args(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_dir()
    tokenizer = Tokenizer.from_model_dir(model_dir)
    text_ids = tokenizer.encode(Path(args.text).read_text())[: args.max_text_tokens]
    prompts = [chat_prompt(tokenizer, i) for i in range(args.prompts)]
    results, replies = {}, {}
    for quantize in args.formats:
        started = time.perf_counter()
        engine = load(model_dir, quantize, args.window + args.tokens + 64)
        replies[quantize] = [greedy(engine, prompt, args.tokens) for prompt in prompts]
        results[quantize] = {"perplexity": perplexity(engine, text_ids, args.window)}
        results[quantize]["seconds"] = round(time.perf_counter() - started, 1)
    reference = args.formats[0]
    for quantize in args.formats:
        agreed = [agreement(a, b) for a, b in zip(replies[reference], replies[quantize])]
        results[quantize]["agreed_tokens"] = agreed
        results[quantize]["agreement"] = sum(agreed) / (len(agreed) * args.tokens)
        results[quantize]["perplexity_vs_reference"] = (
            results[quantize]["perplexity"] / results[reference]["perplexity"]
        )
    print_table(
        f"quality on {len(text_ids)} tokens of {args.text} (windows of {args.window}) and {len(prompts)} chat prompts",
        ["format", "perplexity", f"x {reference}", f"greedy agreement (first {args.tokens})"],
        [
            [q, f"{r['perplexity']:.3f}", f"{r['perplexity_vs_reference']:.4f}", f"{r['agreement']:.3f}"]
            for q, r in results.items()
        ],
    )
    report = {"model": model_dir, "text": args.text, "text_tokens": len(text_ids), "window": args.window}
    report |= {"threads": args.threads, "formats": results}
    return finish(report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
