"""What constrained decoding costs a busy server: 16 streams' aggregate tokens/s on two ranks with
and without a JSON schema, in one run on one engine (the default model, greedy).

The constrained streams follow a schema that cannot end before max_tokens (an array of at least
200 strings), the free ones ignore EOS, so every reply is max_tokens long. Drafts are off for both:
a constrained stream takes none (tpserve/server/drafts.py), and this measures the mask, not the drafts.
Tokens/s is counted in the window where every stream decodes (bench/concurrency.py's window); the
two kinds alternate, each its median over rounds.

    python -m bench.grammar_throughput [--streams 16] [--max-tokens 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import (
    GREEDY,
    add_common_args,
    bench_settings,
    chat_prompt,
    default_model_dir,
    finish,
    machine_facts,
    median,
    print_table,
    submit_together,
    watch_streams,
)
from bench.concurrency import decode_window
from tpserve.server.grammar import Grammars
from tpserve.server.requests import GenerationRequest
from tpserve.server.wiring import local_engine
from tpserve.v1 import serving_pb2

SCHEMA = {
    "type": "object",
    "properties": {"facts": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
    "required": ["facts"],
    "additionalProperties": False,
}


def run_grammar_throughput(
    model_dir: str, *, num_streams: int = 16, max_tokens: int = 64, num_rounds: int = 2
) -> dict:
    settings = bench_settings(
        model_dir, tp_size=2, num_lanes=num_streams, context_size=256, draft_tokens=0, batch_invariant=True
    )
    with local_engine(settings) as engine:
        tokenizer = engine.tokenizer
        grammars = Grammars(tokenizer.backend_json, tokenizer.vocab_size, tokenizer.eos_ids)
        constraint = serving_pb2.Constraint(json_schema=json.dumps(SCHEMA))
        compile_s = []
        for _ in range(2):  # the first also reads the tokenizer into the grammar engine
            start = time.perf_counter()
            grammar = grammars.compile(constraint)
            compile_s.append(time.perf_counter() - start)
        prompts = [tuple(chat_prompt(tokenizer, i)) for i in range(num_streams)]
        rates: dict[str, list[float]] = {"free": [], "json schema": []}
        for _ in range(num_rounds):  # alternating, so drift on a shared machine hits both alike
            for name, fields in (("free", {"ignore_eos": True}), ("json schema", {"grammar": grammar})):
                requests = [GenerationRequest(p, max_tokens, GREEDY, **fields) for p in prompts]
                records = watch_streams(submit_together(engine.host, requests))
                if any(len(record.token_ids) != max_tokens for record in records):
                    raise RuntimeError(f"{name}: a reply was not {max_tokens} tokens long")
                num_tokens, seconds = decode_window(records)
                rates[name].append(num_tokens / seconds)
        sample = tokenizer.decode(records[0].token_ids)
        figures = {name: median(values) for name, values in rates.items()}
    return {
        "streams": num_streams,
        "max_tokens": max_tokens,
        "free_tokens_per_s": figures["free"],
        "schema_tokens_per_s": figures["json schema"],
        "schema_over_free": figures["json schema"] / figures["free"],
        "rounds": num_rounds,
        "round_tokens_per_s": rates,
        "first_compile_ms": compile_s[0] * 1e3,
        "schema_compile_ms": compile_s[1] * 1e3,
        "schema_reply_start": sample[:80],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="free and constrained runs, alternating")
    args = parser.parse_args(argv)
    report = run_grammar_throughput(
        args.model or default_model_dir(),
        num_streams=args.streams,
        max_tokens=args.max_tokens,
        num_rounds=args.rounds,
    )
    print_table(
        f"{report['streams']} streams on 2 ranks, {report['max_tokens']} tokens each, greedy, no drafts",
        ["free tok/s", "json schema tok/s", "schema/free", "first compile ms", "compile ms"],
        [
            [
                f"{report['free_tokens_per_s']:.1f}",
                f"{report['schema_tokens_per_s']:.1f}",
                f"{report['schema_over_free']:.2f}",
                f"{report['first_compile_ms']:.0f}",
                f"{report['schema_compile_ms']:.1f}",
            ]
        ],
    )
    print("a constrained reply begins:", repr(report["schema_reply_start"]))
    facts = machine_facts()
    print(json.dumps(facts))
    return finish({**report, "machine": facts}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
