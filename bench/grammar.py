"""Which grammar engine constrains tpserve's sampling: llguidance or xgrammar, measured side by side.

Both compute, before each draw, the set of tokens a grammar allows next (a bitmask over the
vocabulary); the lane host computes one per constrained lane per decode round, on rank 0's CPU. This
times that step for the default model's vocabulary, at 1 and at 16 constrained lanes, for a JSON
schema of a few fields and a regex, each engine stepping every lane through the same valid reply
(tokenized once). It also reports what building a grammar costs (the first-request latency).

llguidance won (see bench/README.md) and is tpserve's dependency; xgrammar is not (it pulls triton
and transformers): `pip install xgrammar` before running this.

    python -m bench.grammar [--steps 48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.common import add_common_args, default_model_dir, finish, machine_facts, median, print_table

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["London", "Paris", "Rome"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
SCHEMA_REPLY = '{"name": "Ada Lovelace", "age": 36, "city": "London", "tags": ["maths", "engines", "notes"]}'
REGEX = r"[A-Z][a-z]+ [0-9]{3}-[0-9]{4} (yes|no)( [a-z]+)*"
REGEX_REPLY = "Lovelace 555-0136 yes she wrote the first program for the analytical engine"
LANE_COUNTS = (1, 16)


class Lanes:
    """`num_lanes` matchers of one engine for one grammar, each to be stepped through `reply`."""

    def __init__(self, fill: Callable[[], None], accept: Callable[[int], None], reset: Callable[[], None]):
        self.fill, self.accept, self.reset = fill, accept, reset


def llguidance_lanes(tokenizer_json: str, vocab_size: int) -> Callable[[str, str, int], Lanes]:
    import llguidance
    import llguidance.numpy as llg_numpy

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size)
    executor = llguidance.LLExecutor()

    def make(kind: str, source: str, num_lanes: int) -> Lanes:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                source, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            )
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(num_lanes)]
        bitmask = llg_numpy.allocate_token_bitmask(num_lanes, vocab_size)
        pairs = [(m, i) for i, m in enumerate(matchers)]

        def fill() -> None:
            if num_lanes == 1:
                llg_numpy.fill_next_token_bitmask(matchers[0], bitmask, 0)
            else:
                llg_numpy.fill_next_token_bitmask_par(executor, pairs, bitmask)

        def accept(token: int) -> None:
            for m in matchers:
                if not m.consume_token(token):
                    raise RuntimeError(f"llguidance refused token {token}: {m.get_error()}")

        def reset() -> None:
            for m in matchers:
                m.reset()

        return Lanes(fill, accept, reset)

    return make


def xgrammar_lanes(model_dir: str, vocab_size: int) -> Callable[[str, str, int], Lanes]:
    import transformers
    import xgrammar

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size))
    batch = xgrammar.BatchGrammarMatcher()

    def make(kind: str, source: str, num_lanes: int) -> Lanes:
        if kind == "json":
            compiled = compiler.compile_json_schema(source, any_whitespace=False, separators=(", ", ": "))
        else:
            compiled = compiler.compile_regex(source)
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(num_lanes)]
        bitmask = xgrammar.allocate_token_bitmask(num_lanes, vocab_size)

        def fill() -> None:
            if num_lanes == 1:
                matchers[0].fill_next_token_bitmask(bitmask, 0)
            else:
                batch.batch_fill_next_token_bitmask(matchers, bitmask)

        def accept(token: int) -> None:
            for m in matchers:
                if not m.accept_token(token):
                    raise RuntimeError(f"xgrammar refused token {token}")

        def reset() -> None:
            for m in matchers:
                m.reset()

        return Lanes(fill, accept, reset)

    return make


def step_times(lanes: Lanes, reply_ids: Sequence[int], num_steps: int) -> list[float]:
    """Seconds per mask computation (all lanes at once), stepping through the reply repeatedly."""
    times = []
    at = 0
    lanes.reset()
    while len(times) < num_steps:
        start = time.perf_counter()
        lanes.fill()
        times.append(time.perf_counter() - start)
        lanes.accept(reply_ids[at])
        at += 1
        if at == len(reply_ids):
            at = 0
            lanes.reset()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--steps", type=int, default=48, help="mask computations timed per case")
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer

    try:
        import xgrammar  # noqa: F401
    except ImportError:
        print("bench.grammar compares against xgrammar, which tpserve does not install: pip install xgrammar")
        return 1

    model_dir = default_model_dir()
    tokenizer_json = (Path(model_dir) / "tokenizer.json").read_text()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    grammars = {
        "json schema": ("json", json.dumps(SCHEMA), tokenizer.encode(SCHEMA_REPLY).ids),
        "regex": ("regex", REGEX, tokenizer.encode(REGEX_REPLY).ids),
    }
    engines = {
        "llguidance": llguidance_lanes(tokenizer_json, vocab_size),
        "xgrammar": xgrammar_lanes(model_dir, vocab_size),
    }
    rows, report_cases = [], []
    for grammar_name, (kind, source, reply_ids) in grammars.items():
        for num_lanes in LANE_COUNTS:
            figures = {}
            for engine_name, make in engines.items():
                start = time.perf_counter()
                lanes = make(kind, source, num_lanes)
                build_s = time.perf_counter() - start
                step_times(lanes, reply_ids, 4)  # warm-up
                figures[engine_name] = (median(step_times(lanes, reply_ids, args.steps)), build_s)
            llg, xgr = figures["llguidance"][0], figures["xgrammar"][0]
            rows.append(
                [
                    grammar_name,
                    num_lanes,
                    f"{llg * 1e3:.3f}",
                    f"{xgr * 1e3:.3f}",
                    f"{xgr / llg:.2f}",
                    f"{figures['llguidance'][1] * 1e3:.0f}",
                    f"{figures['xgrammar'][1] * 1e3:.0f}",
                ]
            )
            report_cases.append(
                {
                    "grammar": grammar_name,
                    "lanes": num_lanes,
                    "llguidance_mask_ms": llg * 1e3,
                    "xgrammar_mask_ms": xgr * 1e3,
                    "xgrammar_over_llguidance": xgr / llg,
                    "llguidance_build_ms": figures["llguidance"][1] * 1e3,
                    "xgrammar_build_ms": figures["xgrammar"][1] * 1e3,
                }
            )
    print_table(
        f"mask time per step (median of {args.steps}), vocabulary {vocab_size}",
        ["grammar", "lanes", "llguidance ms", "xgrammar ms", "xgr/llg", "llg build ms", "xgr build ms"],
        rows,
    )
    facts = machine_facts()
    print(json.dumps(facts))
    return finish({"machine": facts, "vocab_size": vocab_size, "cases": report_cases}, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
