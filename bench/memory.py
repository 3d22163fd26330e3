"""Weight bytes each rank holds, per format, against its share of the GGUF the default model ships as.

Issue 13's target: resident weight bytes per rank at most 1.25x that rank's share of the GGUF file.
The share is counted as the file's size over tp (the file's metadata and tokenizer included); rank 0
holds more than half of the model (2 of SmolLM2's 3 KV heads), so against its own share the ratio
would be lower still. Each rank's shard is loaded in this process (`TPModel.weight_bytes`: every
tensor and packed weight once, a tied head and embedding sharing theirs).

    python -m bench.memory [--formats none int8 int4] [--tp 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import add_common_args, default_model_dir, finish, print_table  # noqa: E402
from tpserve.kernels.linear import ROW_TILE  # noqa: E402
from tpserve.prepare import find_default_gguf  # noqa: E402
from tpserve.ranks.loader import load_rank_model  # noqa: E402
from tpserve.ranks.settings import QUANTIZE_CHOICES  # noqa: E402

TARGET = 1.25


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    formats = [q for q in QUANTIZE_CHOICES if q != "auto"]
    parser.add_argument("--formats", nargs="+", default=formats, choices=formats)
    parser.add_argument("--tp", type=int, default=2)
    add_common_args(parser)
    args = parser.parse_args(argv)
    model_dir = args.model or default_model_dir()
    gguf_bytes = find_default_gguf().stat().st_size
    share = gguf_bytes / args.tp
    rows, report = [], {"model": model_dir, "gguf_bytes": gguf_bytes, "tp": args.tp, "formats": {}}
    for quantize in args.formats:
        per_rank = []
        for rank in range(args.tp):
            model = load_rank_model(
                model_dir,
                tp_rank=rank,
                tp_size=args.tp,
                dtype=torch.float32,
                max_positions=64,
                row_tile=ROW_TILE,
                quantize=quantize,
            )
            per_rank.append(model.weight_bytes())
            del model
        ratio = max(per_rank) / share
        report["formats"][quantize] = {"rank_bytes": per_rank, "x_gguf_share": ratio}
        rows.append(
            (
                quantize,
                *(f"{b / 1e6:.1f}" for b in per_rank),
                f"{ratio:.2f}",
                "yes" if ratio <= TARGET else "no",
            )
        )
    print_table(
        f"weight MB per rank (the GGUF: {gguf_bytes / 1e6:.1f} MB, a share {share / 1e6:.1f} MB)",
        ("format", *(f"rank {r}" for r in range(args.tp)), "x share (most)", f"<= {TARGET}"),
        rows,
    )
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
