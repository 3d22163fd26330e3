"""Logging with the rank in every line."""

from __future__ import annotations

import logging


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        force=True,
    )
