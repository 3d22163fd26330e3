"""Opening an engine's lanes in tests that drive ranks/engine.py directly (ranks/engine.py open_lane)."""

from __future__ import annotations

from tpserve.ranks.engine import open_lane

__all__ = ["open_lane"]
