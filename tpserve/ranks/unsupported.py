"""What a checkpoint asks for that tpserve does not compute, refused by name rather than served wrong.

A config key that changes the math (logit soft-capping, a bias on o_proj, a partial rotary) and
that the model does not implement would otherwise load and give wrong logits with no word said.
Each is refused here, naming the model, the feature and its value. Sliding windows are computed
(per layer, by every attention kernel); this file reads which layers slide.
"""

from __future__ import annotations

from pathlib import Path

from tpserve.kernels.rope_scaling import RopeScaling
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.gemma3_config import GEMMA3_ACTIVATIONS

# Known architectures tpserve does not load, and what in them it does not compute.
REFUSED_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA) and its mixture of experts",
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA) and its mixture of experts",
    "Qwen3NextForCausalLM": "hybrid linear-attention (Gated DeltaNet) layers",
    "Qwen3_5ForCausalLM": "hybrid linear-attention (Gated DeltaNet) layers",
    "Qwen3_5ForConditionalGeneration": "hybrid linear-attention (Gated DeltaNet) layers",
    "Qwen3_5MoeForCausalLM": "hybrid linear-attention (Gated DeltaNet) layers",
    "Qwen3_5MoeForConditionalGeneration": "hybrid linear-attention (Gated DeltaNet) layers",
    "DeepseekV32ForCausalLM": "multi-head latent attention (MLA) and DeepSeek's sparse attention",
    "Glm4MoeLiteForCausalLM": "multi-head latent attention (MLA)",  # GLM-4.7-Flash
    "GlmMoeDsaForCausalLM": "multi-head latent attention (MLA) and DeepSeek's sparse attention",  # GLM-5
    "KimiLinearForCausalLM": "hybrid linear-attention layers and multi-head latent attention (MLA)",
    "LongcatFlashForCausalLM": "multi-head latent attention (MLA) and its zero-computation experts",
    "MiniCPM3ForCausalLM": "multi-head latent attention (MLA)",
    "Gemma2ForCausalLM": "logit soft-capping and alternating sliding-window layers",
    # Qwen3-VL's dense model is computed (tpserve/ranks/qwen3_vision.py); its MoE text model is not.
    "Qwen3VLMoeForConditionalGeneration": "Qwen3-VL's mixture-of-experts text model (with deepstack features)",
}
# Families whose configs turn a sliding window on with a flag (transformers' Qwen2 and Qwen3:
# `use_sliding_window`); in the others a `sliding_window` set is a window in force.
FLAGGED_WINDOW = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
# Families whose transformers model reads `layer_types` (5.25's); the others' windows follow their
# own rule whatever layer_types a config carries, so one that says otherwise is refused.
LAYER_TYPED = ("qwen2", "qwen3", "qwen2_moe", "gemma3", "gpt_oss")
# Keys only a multi-head latent attention (MLA) config carries (DeepSeek-V2/V3's, Kimi K2's).
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")
# Families whose partial rotary is computed (tpserve/ranks/partial_rotary.py), and transformers'
# default partial_rotary_factor for each
PARTIAL_ROTARY = {"glm4_moe": 0.5, "phi3": 1.0, "glm4v": 1.0}
WINDOWLESS = ("llama", "glm4_moe")  # transformers' have no sliding window, whatever the config carries
ACTIVATIONS = ("silu", "swish")  # SwiGLU's
# Layer kinds tpserve computes: full causal attention, and causal within a sliding window.
FULL_LAYERS = ("full_attention",)
SLIDING_LAYERS = ("sliding_attention",)


def refuse_architecture(architectures: list[str], path: str | Path) -> None:
    """A known architecture that tpserve does not implement, refused with what it lacks."""
    for architecture in architectures:
        if architecture in REFUSED_ARCHITECTURES:
            raise ModelFileError(
                path,
                f"{architecture} is not supported: {REFUSED_ARCHITECTURES[architecture]} not implemented",
            )


def refuse_unimplemented(raw: dict, family: str, architecture: str, path: str | Path) -> None:
    """Every config key of `raw` that changes the math and that the model does not compute."""

    def refuse(feature: str) -> None:
        raise ModelFileError(path, f"{architecture}: {feature} is not implemented")

    for key in MLA_KEYS:
        if raw.get(key):
            refuse(f"multi-head latent attention (MLA, {key} {raw[key]})")
    kinds = sorted(set(raw.get("layer_types") or ()) - set(FULL_LAYERS) - set(SLIDING_LAYERS))
    if kinds:
        refuse(f"layer_types {kinds}")
    gemma3 = family == "gemma3"  # its GeGLU, final soft-capping and rotary per layer type
    for key in (
        ("attn_logit_softcapping",) if gemma3 else ("attn_logit_softcapping", "final_logit_softcapping")
    ):
        if raw.get(key) is not None:
            refuse(f"{key} {raw[key]}")
    activations = GEMMA3_ACTIVATIONS if gemma3 else ACTIVATIONS
    for key in ("hidden_act", "hidden_activation"):
        if key in raw and raw[key] not in activations:
            refuse(f"{key} {raw[key]!r} (only {'GeGLU' if gemma3 else 'SwiGLU'}'s {activations[0]} is)")
    if raw.get("mlp_bias"):
        refuse("mlp_bias (biases on gate, up and down)")
    if raw.get("lm_head_bias"):  # (Phi-4-mini's config names it, false)
        refuse("lm_head_bias (a bias on the head)")
    # gpt-oss: o_proj's too; GLM-4.5: q, k and v only
    if family not in ("qwen2", "gpt_oss", "glm4_moe") and raw.get("attention_bias"):
        refuse("attention_bias (transformers puts a bias on o_proj too)")
    rope = raw.get("rope_parameters") or {}
    partial = raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and family not in PARTIAL_ROTARY:
        refuse(f"partial rotary embedding (partial_rotary_factor {partial})")
    if gemma3 and set(rope) <= {"full_attention", "sliding_attention"}:
        for kind, parameters in rope.items():  # transformers reads each kind's own
            partial = (parameters or {}).get("partial_rotary_factor", 1.0)
            if partial != 1.0:
                refuse(f"partial rotary embedding ({kind} partial_rotary_factor {partial})")
        rope = {}  # tpserve/ranks/gemma3_config.py reads them
    if any(isinstance(value, dict) for value in rope.values()):
        refuse("rotary parameters per layer type")


def layer_windows(raw: dict, family: str, path: str | Path) -> tuple[int, ...]:
    """Each layer's sliding window (tokens a query sees, its own included; 0: the whole context).
    `layer_types` (transformers 5 writes it) says which layers slide in the families whose model
    reads it; without it, and in the other families, the family's own rule does."""
    window = raw.get("sliding_window")
    num_layers = int(raw.get("num_hidden_layers", 0))
    layer_types = raw.get("layer_types")
    if layer_types is not None and len(layer_types) != num_layers:
        raise ModelFileError(path, f"layer_types names {len(layer_types)} layers of {num_layers}")
    if layer_types is not None and family in LAYER_TYPED:
        sliding = [kind in SLIDING_LAYERS for kind in layer_types]
    else:
        sliding = _family_sliding(raw, family, num_layers, path)
        if layer_types is not None and [kind in SLIDING_LAYERS for kind in layer_types] != sliding:
            rule = [layer for layer, slides in enumerate(sliding) if slides]
            raise ModelFileError(
                path,
                f"{family}: layer_types {layer_types} is not implemented (transformers' model reads none; "
                f"by the family's own rule the sliding layers are {rule})",
            )
    if any(sliding) and not window:
        raise ModelFileError(path, "sliding-window layers but no sliding_window given")
    return tuple(int(window) if slides else 0 for slides in sliding)


def _family_sliding(raw: dict, family: str, num_layers: int, path: str | Path) -> list[bool]:
    """Which layers slide by the family's own rule, as transformers' config class derives it."""
    window = raw.get("sliding_window")
    if family in WINDOWLESS:
        return [False] * num_layers
    if family == "gemma3":  # older configs: every sliding_window_pattern-th layer global
        pattern = int(raw.get("sliding_window_pattern", 6))
        return [bool((layer + 1) % pattern) for layer in range(num_layers)]
    if family == "gpt_oss":  # even layers slide, odd ones attend to everything
        return [bool((layer + 1) % 2) for layer in range(num_layers)]
    if family == "qwen2_moe" and raw.get("use_sliding_window"):
        # transformers 4 slid the layers from max_window_layers on, 5 the even ones below it
        raise ModelFileError(
            path, "Qwen2MoeForCausalLM: use_sliding_window without layer_types is not implemented"
        )
    first = raw.get("max_window_layers", 28)
    if family == "qwen3_moe" and raw.get("use_sliding_window") and first:
        # transformers 4 slid the layers from max_window_layers on, 5 slides every one: they agree at 0
        raise ModelFileError(
            path,
            f"Qwen3MoeForCausalLM: use_sliding_window with max_window_layers {first} is not implemented "
            "(transformers 4 slides the layers from it on, 5 every layer)",
        )
    if family in FLAGGED_WINDOW:  # layers from max_window_layers on slide, where the flag is on
        return [bool(raw.get("use_sliding_window")) and layer >= first for layer in range(num_layers)]
    return [window is not None] * num_layers


def check_served_context(
    architecture: str, window: int | None, scaling: RopeScaling, context_size: int, path
) -> str | None:
    """Refuses longrope past its original context; else a line for the log where a sliding window
    is in force, None where none is."""
    original = scaling.original_max_position_embeddings
    if scaling.rope_type == "longrope" and context_size > original:
        # transformers switches to the long factors once a sequence outgrows the original context,
        # re-rotating every position: not implemented.
        raise ModelFileError(
            path,
            f"{architecture}: longrope's long factors (past {original} positions) are not implemented: "
            f"serve --context {original} or less, where the short factors hold",
        )
    if window is None:
        return None
    # transformers' window: a query sees the `window` latest positions, itself included.
    if context_size > window:
        return (
            f"{architecture} attends within a sliding window of {window} tokens on its sliding layers "
            f"(a context of {context_size}): keys behind every window are not read"
        )
    return (
        f"{architecture}'s sliding window of {window} tokens never binds at a context of {context_size}: "
        "full attention is exact"
    )
