"""How a checkpoint scales its rotary positions: a plain, torch-free value read from its config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: its correction range cut to whole dimensions (gpt-oss: not)
    # longrope (Phi-3's): a divisor per frequency (the short ones, within the original context) and
    # the factor cos and sin are scaled by
    short_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
