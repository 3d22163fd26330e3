"""What Gemma 3's config adds to a Llama-style decoder's shape (tpserve/ranks/models/gemma3.py computes it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError

GEMMA3_TEXT_TYPES = ("gemma3_text",)
GEMMA3_ACTIVATIONS = ("gelu_pytorch_tanh",)  # GeGLU's gate, tanh-approximated GELU
LOCAL_THETA, GLOBAL_THETA = 10_000.0, 1_000_000.0  # transformers' Gemma3TextConfig defaults


@dataclass(frozen=True)
class Gemma3Shape:
    """query_pre_attn_scalar: attention scales q.k by its -1/2 power (not head_dim's); local_theta:
    the rotary base of the sliding (local) layers, the global ones using the config's rope_theta
    and scaling; final_logit_softcapping: logits become cap * tanh(logits / cap), where set."""

    query_pre_attn_scalar: float
    local_theta: float
    final_logit_softcapping: float | None


def global_and_local_rope(raw: dict) -> tuple[dict, float]:
    """The global layers' rope parameters (rope_theta and any scaling, as a flat rope_parameters)
    and the local layers' base: transformers 5 writes them per layer type, older configs as
    rope_theta, rope_scaling and rope_local_base_freq."""
    rope = raw.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        full = dict(rope.get("full_attention") or {})
        local = rope.get("sliding_attention") or {}
        full.setdefault("rope_theta", GLOBAL_THETA)
        return full, float(local.get("rope_theta", LOCAL_THETA))
    full = {"rope_theta": raw.get("rope_theta", GLOBAL_THETA)} | (raw.get("rope_scaling") or {})
    return full, float(raw.get("rope_local_base_freq", LOCAL_THETA))


def parse_gemma3(raw: dict, path: str | Path) -> Gemma3Shape:
    """Gemma 3's own keys, refusing those that change the math and are not computed."""
    if raw.get("use_bidirectional_attention"):
        raise ModelFileError(path, "Gemma3: use_bidirectional_attention is not implemented")
    _, local_theta = global_and_local_rope(raw)
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelFileError(path, f"Gemma3: local rope type {local['rope_type']!r} is not implemented")
    cap = raw.get("final_logit_softcapping")
    return Gemma3Shape(
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        local_theta=local_theta,
        final_logit_softcapping=None if cap is None else float(cap),
    )
