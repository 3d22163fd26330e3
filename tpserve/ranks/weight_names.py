"""The tensors a model's config implies in its checkpoint: their names, shapes, and which stay float32."""

from __future__ import annotations

from tpserve.ranks.model_config import ModelConfig

FLOAT32_NORMS = ("gemma3", "gpt_oss")


def expected_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    expert = config.moe.expert_shape(name, config.hidden_size) if config.moe else None
    if expert is not None:
        return expert
    moe = config.moe
    if moe and name.endswith(f"{moe.prefix}{moe.router}.weight"):  # the router
        return (moe.num_experts, config.hidden_size)
    if moe and name.endswith(f"{moe.prefix}{moe.router}.bias"):
        return (moe.num_experts,)
    if moe and name.endswith("experts.down_proj_bias"):  # every expert's (gpt-oss)
        return (moe.num_experts, config.hidden_size)
    if moe and name.endswith(".e_score_correction_bias"):  # GLM-4.5's router
        return (moe.num_experts,)
    if moe and name.endswith(".shared_expert_gate.weight"):  # Qwen2-MoE's
        return (1, config.hidden_size)
    if moe and f".{moe.prefix}{moe.shared_stem}" in name:
        down = name.endswith("down_proj.weight")
        return (config.hidden_size, moe.shared_size) if down else (moe.shared_size, config.hidden_size)
    key = name.rsplit(".", 2)
    leaf = ".".join(key[-2:])
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    shapes = {
        "embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "lm_head.weight": (config.vocab_size, config.hidden_size),
        "q_proj.weight": (q_width, config.hidden_size),
        "q_proj.bias": (q_width,),
        "k_proj.weight": (kv_width, config.hidden_size),
        "k_proj.bias": (kv_width,),
        "v_proj.weight": (kv_width, config.hidden_size),
        "v_proj.bias": (kv_width,),
        "o_proj.weight": (config.hidden_size, q_width),
        "self_attn.sinks": (config.num_heads,),
        "q_norm.weight": (config.head_dim,),
        "k_norm.weight": (config.head_dim,),
        "gate_proj.weight": (config.intermediate_size, config.hidden_size),
        "up_proj.weight": (config.intermediate_size, config.hidden_size),
        "down_proj.weight": (config.hidden_size, config.intermediate_size),
    }
    return shapes.get(leaf, (config.hidden_size,))


def required_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
    ]
    dense = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    if config.qkv_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    per_layer += ["self_attn.o_proj.bias"] if config.o_bias else []
    per_layer += ["self_attn.sinks"] if config.sinks else []
    if config.gemma3 is not None:  # norms around the MLP too
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    if config.family == "glm4v":  # norms on the attention's and the MLP's outputs
        per_layer += ["post_self_attn_layernorm.weight", "post_mlp_layernorm.weight"]
    moe = config.moe
    for layer in range(config.num_layers):
        names += [f"model.layers.{layer}.{leaf}" for leaf in per_layer]
        if moe is None or not moe.is_sparse(layer):
            names += [f"model.layers.{layer}.{leaf}" for leaf in dense]
            continue
        names.append(moe.router_name(layer))
        names += [moe.router_bias_name(layer), moe.down_bias_name(layer)] if moe.biased else []
        names += [moe.correction_name(layer)] if moe.grouped else []
        names += list(moe.shared_names(layer)) if moe.shared_size else []
        names += [moe.shared_gate_name(layer)] if moe.shared_gate else []
        for expert in range(moe.num_experts):
            names += moe.expert_names(layer, expert)
            names += moe.expert_bias_names(layer, expert) if moe.biased else ()
    return names


def kept_in_float32(config: ModelConfig, name: str) -> bool:
    """A weight kept in float32 whatever the dtype: a norm's in the families whose norms scale in
    float32 and round once (transformers' Gemma3RMSNorm, and GptOssRMSNorm, whose weights it keeps
    in float32), which tpserve/kernels/norms.py does for a float32 weight; and a grouped router's weight
    and score correction (GLM-4.5's, which transformers keeps and computes in float32)."""
    grouped = config.moe is not None and config.moe.grouped is not None
    if grouped and name.endswith((".mlp.gate.weight", ".e_score_correction_bias")):
        return True
    return config.family in FLOAT32_NORMS and name.endswith("norm.weight")
