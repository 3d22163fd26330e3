"""The GGUF architectures `import-gguf` knows: what each becomes in config.json, and how llama.cpp's
convert_hf_to_gguf wrote it.

Dense `llama` (q/k rows permuted for llama.cpp's rotary kernel; with experts, Mixtral), `qwen2` and
`qwen3`. `gemma3`, whose
norms llama.cpp stores plus one (Gemma3RMSNorm scales by 1 + w; the import takes the one off again),
whose norms around attention and the MLP are `post_attention_norm`, `ffn_norm` and `post_ffw_norm`,
and whose layers llama.cpp makes global every sixth (unless the file says otherwise), the local ones
on a rotary base of 10000, scaling q.k by head_dim^-1/2 (hidden / heads for the 62-layer 27B). `phi3`,
its q/k/v fused as `attn_qkv` and gate/up as `ffn_up` (tpserve/ranks/fused_tensors.py splits them on load),
its longrope factors as the tensors `rope_factors_short` and `rope_factors_long` (half the rotary
dims each: Phi-4-mini rotates `phi3.rope.dimension_count` of a head's dims, its partial rotary). And the
mixtures of experts `qwen3moe` and `gpt-oss`, whose experts llama.cpp stacks into one tensor a
projection (`blk.N.ffn_gate_exps.weight` [E, I, hidden] in torch order, `ffn_up_exps`, `ffn_down_exps`
[E, hidden, I]; gpt-oss's gate and up split out of its interleaved gate_up_proj, biases beside them as
`.bias`). The router is `ffn_gate_inp`. A qwen3moe layer without one is dense (Qwen3-MoE's
`mlp_only_layers`). `qwen2moe` is qwen3moe's layout plus a shared expert (`ffn_gate_shexp`,
`ffn_up_shexp`, `ffn_down_shexp`) and its gate (`ffn_gate_inp_shexp`, one row). `glm4moe` (GLM-4.5/4.6,
unpermuted: its rotary is rotate-half already) has the same shared expert without a gate, the router's
score correction as `exp_probs_b.bias`, dense leading layers (`leading_dense_block_count`), the norm
before the MLP as `post_attention_norm`, a partial rotary (`rope.dimension_count`), and its
multi-token-prediction layers as extra blocks (`nextn_predict_layers` of them, counted in
`block_count`, with `nextn.*` tensors): tpserve runs no MTP drafts, so they are skipped. gpt-oss
keeps its sinks as `attn_sinks.weight`, the norm before its experts as `post_attention_norm`, and
alternates sliding (even) and full (odd) layers, as llama.cpp computes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tpserve.ranks.errors import ModelFileError

# transformers' GptOssConfig: yarn's correction range and its untruncated bounds, which GGUF keeps
# only where the writer knew the yarn keys
GPT_OSS_YARN = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
SIGMOID_GATING = 2  # gguf's ExpertGatingFuncType.SIGMOID


def _qwen3moe(metadata: dict[str, Any], tensors: dict, need: Callable[[str], Any], gguf_path: Path) -> dict:
    num_layers, names = need("block_count"), set(tensors)
    return {
        "num_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "moe_intermediate_size": need("expert_feed_forward_length"),
        # llama.cpp renormalises qwen3moe's top k whatever the file says; Qwen3-MoE's own do too
        "norm_topk_prob": bool(metadata.get("qwen3moe.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
    }


def _qwen2moe(metadata: dict[str, Any], tensors: dict, need: Callable[[str], Any], gguf_path: Path) -> dict:
    """qwen3moe's keys, the shared expert's width, and Qwen2's q/k/v biases (no o bias)."""
    return _qwen3moe(metadata, tensors, need, gguf_path) | {
        # llama.cpp never renormalises qwen2moe's top k, nor do Qwen1.5-MoE's and Qwen2-57B's configs
        "norm_topk_prob": bool(metadata.get("qwen2moe.expert_weights_norm", False)),
        "shared_expert_intermediate_size": need("expert_shared_feed_forward_length"),
        "qkv_bias": "blk.0.attn_q.bias" in tensors,
        "attention_bias": False,
    }


def _glm4moe(metadata: dict[str, Any], tensors: dict, need: Callable[[str], Any], gguf_path: Path) -> dict:
    """GLM-4.5's routing keys, its dense leading layers, shared experts and q/k norms. llama.cpp's
    block_count counts the multi-token-prediction layers past the decoder's; they are not imported."""
    num_mtp = metadata.get("glm4moe.nextn_predict_layers", 0)
    num_layers = need("block_count") - num_mtp
    gating = metadata.get("glm4moe.expert_gating_func", SIGMOID_GATING)
    if gating != SIGMOID_GATING:
        raise ModelFileError(
            gguf_path, f"glm4moe.expert_gating_func {gating} is not sigmoid (2): not implemented"
        )
    routed = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    first_sparse = metadata.get("glm4moe.leading_dense_block_count", routed[0] if routed else num_layers)
    if routed != list(range(first_sparse, num_layers)):
        raise ModelFileError(
            gguf_path,
            f"glm4moe layers {first_sparse}..{num_layers - 1} should each have a router (ffn_gate_inp)",
        )
    return {
        "num_hidden_layers": num_layers,
        "num_nextn_predict_layers": num_mtp,
        "n_routed_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "moe_intermediate_size": need("expert_feed_forward_length"),
        "n_shared_experts": metadata.get("glm4moe.expert_shared_count", 1),
        "first_k_dense_replace": first_sparse,
        # older converters wrote no groups: GLM-4.5's and 4.6's are one group, all kept
        "n_group": metadata.get("glm4moe.expert_group_count", 1),
        "topk_group": metadata.get("glm4moe.expert_group_used_count", 1),
        "routed_scaling_factor": shortest_float32(metadata.get("glm4moe.expert_weights_scale", 1.0)),
        # as llama.cpp reads it: renormalised only where the file says so
        "norm_topk_prob": bool(metadata.get("glm4moe.expert_weights_norm", False)),
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
    }


def _mixtral(metadata: dict[str, Any], tensors: dict, need: Callable[[str], Any], gguf_path: Path) -> dict:
    return {"num_local_experts": need("expert_count"), "num_experts_per_tok": need("expert_used_count")}


def _gpt_oss(metadata: dict[str, Any], tensors: dict, need: Callable[[str], Any], gguf_path: Path) -> dict:
    num_layers, names = need("block_count"), set(tensors)
    extra = {
        "num_local_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        "intermediate_size": need("expert_feed_forward_length"),
        "sliding_window": need("attention.sliding_window"),
        "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)],
        "attention_bias": True,
    }
    missing = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    if missing:
        raise ModelFileError(gguf_path, f"gpt-oss layers {missing} have no router (ffn_gate_inp)")
    return extra


def _gemma3(metadata: dict[str, Any], tensors: dict, need: Callable[[str], Any], gguf_path: Path) -> dict:
    num_layers = need("block_count")
    # one flag a layer (true: sliding), or every pattern-th layer global
    pattern = metadata.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [bool((layer + 1) % pattern) for layer in range(num_layers)]
    head_dim = need("embedding_length") // need("attention.head_count")
    if num_layers != 62:  # the 27B scales by (hidden / heads)^-1/2, the others by head_dim's
        head_dim = metadata.get("gemma3.attention.key_length", head_dim)
    extra = {
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": need("attention.sliding_window"),
        "layer_types": ["sliding_attention" if slides else "full_attention" for slides in sliding],
        "query_pre_attn_scalar": head_dim,
        "rope_local_base_freq": shortest_float32(metadata.get("gemma3.rope.freq_base_swa", 10000.0)),
    }
    cap = metadata.get("gemma3.final_logit_softcapping")
    if cap:
        extra["final_logit_softcapping"] = shortest_float32(cap)
    return extra


def _phi3(metadata: dict[str, Any], tensors: dict, need: Callable[[str], Any], gguf_path: Path) -> dict:
    window = metadata.get("phi3.attention.sliding_window", 0)
    extra: dict[str, Any] = {"sliding_window": window or None}
    original = metadata.get("phi3.rope.scaling.original_context_length")
    if original:
        extra["original_max_position_embeddings"] = original
    if "rope_factors_short.weight" in tensors:
        if not original:
            raise ModelFileError(
                gguf_path, "longrope factors but no phi3.rope.scaling.original_context_length"
            )
        extra["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": [shortest_float32(v) for v in tensors["rope_factors_short.weight"].data],
            "long_factor": [shortest_float32(v) for v in tensors["rope_factors_long.weight"].data],
            "original_max_position_embeddings": original,
        }
    return extra


@dataclass(frozen=True)
class Family:
    """A GGUF `general.architecture` the importer knows, and what it becomes in config.json."""

    architecture: str
    model_type: str
    permutes_qk: bool  # llama.cpp's convert_hf_to_gguf reorders q/k rows for its rotary kernel
    # GGUF leaf -> HF leaf, beyond (or instead of) the dense ones; "{}": an expert's number
    layer_names: dict[str, str] = field(default_factory=dict)
    # (metadata, tensors by name, need, path) -> config.json keys beyond the dense ones
    extra_config: Callable[..., dict[str, Any]] | None = None
    yarn: dict[str, Any] = field(default_factory=dict)  # yarn keys GGUF may leave out
    norm_shift: float = 0.0  # what llama.cpp added to every norm weight (taken off again)
    config_tensors: tuple[str, ...] = ()  # tensors read into config.json, not written
    partial_rotary: bool = False  # a rope.dimension_count below the head's (Phi-4-mini's, GLM-4.5's)
    mtp_layers: bool = False  # blocks past num_hidden_layers are multi-token prediction's (not imported)


_MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
}
_QWEN2MOE_NAMES = _MOE_NAMES | {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",  # [1, hidden] (or [hidden])
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_GLM4MOE_NAMES = _MOE_NAMES | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_GPT_OSS_NAMES = _MOE_NAMES | {
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.bias": "mlp.experts.{}.gate_proj.bias",
    "ffn_up_exps.bias": "mlp.experts.{}.up_proj.bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",  # [E, hidden], kept whole
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
}

_MIXTRAL_NAMES = {
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{}.w2.weight",
}
# llama.cpp writes Mixtral as `llama` with experts (an expert count in its metadata)
MIXTRAL = Family("MixtralForCausalLM", "mixtral", True, _MIXTRAL_NAMES, _mixtral)
_GEMMA3_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_PHI3_NAMES = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
_PHI3_CONFIG_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")

FAMILIES = {
    "llama": Family("LlamaForCausalLM", "llama", permutes_qk=True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", permutes_qk=False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", permutes_qk=False),
    "qwen3moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", False, _MOE_NAMES, _qwen3moe),
    "qwen2moe": Family("Qwen2MoeForCausalLM", "qwen2_moe", False, _QWEN2MOE_NAMES, _qwen2moe),
    "glm4moe": Family(
        "Glm4MoeForCausalLM",
        "glm4_moe",
        False,
        _GLM4MOE_NAMES,
        _glm4moe,
        partial_rotary=True,
        mtp_layers=True,
    ),
    "gpt-oss": Family("GptOssForCausalLM", "gpt_oss", False, _GPT_OSS_NAMES, _gpt_oss, GPT_OSS_YARN),
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", False, _GEMMA3_NAMES, _gemma3, norm_shift=1.0),
    "phi3": Family(
        "Phi3ForCausalLM",
        "phi3",
        False,
        _PHI3_NAMES,
        _phi3,
        config_tensors=_PHI3_CONFIG_TENSORS,
        partial_rotary=True,
    ),
}


def shortest_float32(value: float) -> float:
    """GGUF stores these as float32; the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06) is what the original config.json said."""
    return float(str(np.float32(value)))


def family_of(metadata: dict[str, Any], gguf_path: Path) -> Family:
    arch = metadata.get("general.architecture")
    if arch == "llama" and metadata.get("llama.expert_count"):
        return MIXTRAL
    family = FAMILIES.get(arch)
    if family is None:
        raise ModelFileError(
            gguf_path, f"architecture {arch!r} is not supported (known: {', '.join(FAMILIES)})"
        )
    return family
