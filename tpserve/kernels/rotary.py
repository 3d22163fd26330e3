"""Rotary position embedding tables (with the common scalings) and their application."""

from __future__ import annotations

import math

import torch

from tpserve.kernels.rope_scaling import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies [head_dim/2] and the attention scale factor yarn asks for."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.rope_type
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    if kind == "longrope":  # within the original context: the short factors, as transformers does
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (torch.tensor(scaling.short_factor) * theta**shape), scaling.attention_factor
    raise ValueError(f"unknown rope scaling {kind!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    old_context = s.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(old_context / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
    extrapolation = 1 - ramp.clamp(0, 1)
    interpolated = inv_freq / s.factor
    mixed = interpolated * (1 - extrapolation) + inv_freq * extrapolation
    attention_factor = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return mixed, attention_factor


def partial_rotary_order(head_dim: int, rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """The order of a head's dims [head_dim] under which a partial rotary is rotate-half over the
    whole head: new dim j holds old dim order[j].

    A partial rotary (GLM-4.5's) turns pairs (i, i + R/2) of the first R dims and leaves the rest;
    an interleaved one (GLM-4's and GLM-4.1V's, transformers' rotate_half_llm) turns pairs (2i, 2i + 1).
    Rotate-half over D turns pairs (j, j + D/2). With q's and k's dims reordered alike (their dot
    products unchanged), the rotating pairs sit at (j, j + D/2) for j < R/2 and the resting dims pair
    with each other at rate zero (cos 1, sin 0: unchanged), so every attention kernel serves it."""
    rotary_dim = rotary_dim or head_dim
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    if interleaved:
        firsts, seconds = range(0, rotary_dim, 2), range(1, rotary_dim, 2)
    else:
        firsts, seconds = range(half), range(half, rotary_dim)
    first = [*firsts, *range(rotary_dim, rotary_dim + rest)]
    second = [*seconds, *range(rotary_dim + rest, head_dim)]
    return torch.tensor(first + second)


class Rotary:
    """cos/sin tables for positions 0..max_positions-1, shape [max_positions, head_dim] each.
    rotary_dim: a partial rotary's rotating dims (0: all), laid out as partial_rotary_order says."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling,
        max_positions: int,
        device="cpu",
        rotary_dim: int = 0,
    ):
        inv_freq, factor = inverse_frequencies(rotary_dim or head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos() * factor, angles.sin() * factor  # [max_positions, R/2]
        if rotary_dim:  # the resting pairs: cos 1, sin 0 (not scaled: they are no rotary's)
            rest = (head_dim - rotary_dim) // 2
            cos = torch.cat([cos, torch.ones(max_positions, rest)], dim=-1)
            sin = torch.cat([sin, torch.zeros(max_positions, rest)], dim=-1)
        self.cos = torch.cat([cos, cos], dim=-1).to(device)
        self.sin = torch.cat([sin, sin], dim=-1).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for these positions ([T, 1, D] each, in dtype): built once per pass.

        The sin table's first half is negated, so rotate-half is a plain roll (see apply)."""
        half = self.cos.shape[-1] // 2
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        sin[..., :half] = -sin[..., :half]
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [T, H, D]; the "rotate half" layout of the Hugging Face checkpoints:
        # x * cos + cat(-x2, x1) * sin, where (-x2) * sin1 == x2 * (-sin1) bit for bit.
        cos, signed_sin = tables
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
