"""The `tpserve` command: one subcommand per module, each registering its own parser."""

from __future__ import annotations

import argparse
import logging
import sys

from tpserve import bench, client, generate, gguf_import, prepare, serve
from tpserve.ranks.errors import UserError

# Each module's register(subparsers) adds its subcommand with set_defaults(run=fn); fn(args) returns
# the exit code.
COMMANDS = (prepare, gguf_import, generate, serve, client, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        return int(args.run(args) or 0)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
