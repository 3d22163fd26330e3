"""A tiny transformers checkpoint written as GGUF the way llama.cpp's convert_hf_to_gguf writes its
architecture: the same tensor names, shapes and metadata keys (gguf-py's GGUFWriter), experts stacked
[E, out, in] a projection, gpt-oss's interleaved gate_up_proj split into gate and up.

`write_gguf` returns the checkpoint's tensors as the GGUF holds them: where experts were quantized,
their values rounded, so a transformers model loaded from those (`write_reference`) is the model
the GGUF describes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file, save_file
from test_gguf_import import llama_cpp_permute

Q = gguf.GGMLQuantizationType
NUM_MTP = 1  # glm4moe: one multi-token-prediction layer, as GLM-4.5's
ARCHS = {
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "GptOssForCausalLM": "gpt-oss",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "llama",
    "Glm4MoeForCausalLM": "glm4moe",
}
# each architecture's names for the norms after attention (and around gemma3's MLP), and fused weights
ARCH_NAMES = {
    "qwen3moe": {"post_attention_layernorm.weight": "ffn_norm.weight"},
    "qwen2moe": {
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
        "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    },
    "gpt-oss": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
    "gemma3": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
    "llama": {
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    },
    "glm4moe": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    },
    "phi3": {
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.qkv_proj.weight": "attn_qkv.weight",
        "mlp.gate_up_proj.weight": "ffn_up.weight",
    },
}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_gguf(
    model_dir: Path,
    gguf_path: Path,
    expert_type: Q = Q.F32,
    random_blocks: Callable | None = None,
    layer_type: Q = Q.F32,
    pre: str = "default",
) -> dict[str, np.ndarray]:
    """`model_dir`'s model as GGUF at `gguf_path`, its experts in `expert_type`: quantized by gguf-py,
    or (a K-quant, which gguf-py cannot quantize to) `random_blocks(shape, expert_type)`'s raw blocks;
    the layers' other matrices in `layer_type` (gguf-py's); `pre` names llama.cpp's pre-tokenizer."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    hf = load_file(str(model_dir / "model.safetensors"))
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(gguf_path), arch)
    _write_metadata(writer, config, arch)
    _write_vocab(writer, model_dir, pre)
    for name in sorted(hf):
        # Gemma3Model's norm_shift: llama.cpp's norms scale by w, Gemma3RMSNorm's by 1 + w
        values = hf[name] + np.float32(1) if arch == "gemma3" and name.endswith("norm.weight") else hf[name]
        if name in GLOBAL_NAMES:
            writer.add_tensor(GLOBAL_NAMES[name], values)
            continue
        layer, leaf = name.removeprefix("model.layers.").split(".", 1)
        gguf_leaf = ARCH_NAMES[arch].get(leaf, LAYER_NAMES.get(leaf))
        if arch == "llama" and leaf in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = config["num_attention_heads" if "q_proj" in leaf else "num_key_value_heads"]
            values = llama_cpp_permute(values, heads)
        if gguf_leaf is not None and (layer_type == Q.F32 or values.ndim != 2):
            writer.add_tensor(f"blk.{layer}.{gguf_leaf}", values)
        elif gguf_leaf is not None:
            raw = gguf.quants.quantize(values, layer_type)
            writer.add_tensor(f"blk.{layer}.{gguf_leaf}", raw, raw_dtype=layer_type)
            hf[name] = gguf.quants.dequantize(raw, layer_type).reshape(values.shape)
    if arch == "glm4moe":  # the MTP layer transformers does not build, as llama.cpp writes it
        _write_mtp_layer(writer, config)
    if arch == "phi3" and rope.get("rope_type") == "longrope":  # Phi3MiniModel's extra tensors
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for layer in range(config["num_hidden_layers"]):
        if arch == "gpt-oss":
            stacks = _gpt_oss_experts(hf, layer)
        elif arch == "llama":  # Mixtral's block_sparse_moe.experts.N.w1 (gate), w3 (up), w2 (down)
            stacks = _stacked_experts(
                hf, f"model.layers.{layer}.block_sparse_moe.experts.", ("w1", "w3", "w2")
            )
        else:
            stacks = _stacked_experts(
                hf, f"model.layers.{layer}.mlp.experts.", ("gate_proj", "up_proj", "down_proj")
            )
        for leaf, (values, put_back) in stacks.items():
            if expert_type == Q.F32 or leaf.endswith(".bias"):
                writer.add_tensor(f"blk.{layer}.{leaf}", values)
                continue
            raw = (
                random_blocks(values.shape, expert_type)
                if random_blocks is not None
                else gguf.quants.quantize(values, expert_type)
            )
            writer.add_tensor(f"blk.{layer}.{leaf}", raw, raw_dtype=expert_type)
            put_back(gguf.quants.dequantize(raw, expert_type).reshape(values.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def write_reference(model_dir: Path, out_dir: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A copy of `model_dir` holding `tensors` (write_gguf's, rounded as the GGUF holds them)."""
    shutil.copytree(model_dir, out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _write_mtp_layer(writer: gguf.GGUFWriter, config: dict) -> None:
    """A multi-token-prediction block past the decoder's (blk.L, L = num_hidden_layers): some of a
    layer's tensors and its nextn.* ones, random (nothing should read them)."""
    hidden, stem = config["hidden_size"], f"blk.{config['num_hidden_layers']}."
    rng = np.random.default_rng(0)
    shapes = {
        "attn_norm.weight": (hidden,),
        "attn_q.weight": (hidden, hidden),
        "nextn.eh_proj.weight": (hidden, 2 * hidden),
        "nextn.enorm.weight": (hidden,),
        "nextn.hnorm.weight": (hidden,),
        "nextn.shared_head_norm.weight": (hidden,),
    }
    for leaf, shape in shapes.items():
        writer.add_tensor(stem + leaf, rng.standard_normal(shape).astype(np.float32))


def _stacked_experts(hf: dict, prefix: str, projections: tuple[str, str, str]) -> dict:
    """Qwen2MoeModel's (and LlamaModel's, for Mixtral) merge: each expert's gate, up and down stacked
    [E, out, in]; nothing where the layer is dense (Qwen3-MoE's mlp_only_layers)."""
    num_experts = len({n for n in hf if n.startswith(prefix) and n.endswith(f".{projections[0]}.weight")})
    stacks = {}
    for proj, leaf in zip(projections, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
        names = [f"{prefix}{e}.{proj}.weight" for e in range(num_experts)]
        if not names:
            continue

        def put_back(values, names=names):
            hf.update({n: np.ascontiguousarray(v) for n, v in zip(names, values)})

        stacks[f"{leaf}.weight"] = (np.stack([hf[n] for n in names]), put_back)
    return stacks


def _gpt_oss_experts(hf: dict, layer: int) -> dict:
    """GptOssModel's split of float experts: gate_up_proj [E, hidden, 2I] transposed to [E, 2I,
    hidden], gate rows the even ones, up the odd; down_proj [E, I, hidden] transposed; the gate_up bias
    split likewise."""
    stem = f"model.layers.{layer}.mlp.experts."
    gate_up, down = hf.pop(stem + "gate_up_proj"), hf.pop(stem + "down_proj")
    bias = hf.pop(stem + "gate_up_proj_bias")
    rounded = {stem + "gate_up_proj": gate_up.copy(), stem + "down_proj": down.copy()}

    def into(name: str, columns: slice):
        def put_back(values):  # [E, out, in] back to the input-first stored layout
            rounded[name][..., columns] = values.transpose(0, 2, 1)

        return put_back

    hf.update(rounded)
    hf[stem + "gate_up_proj_bias"] = bias
    transposed = gate_up.transpose(0, 2, 1)
    return {
        "ffn_gate_exps.weight": (np.ascontiguousarray(transposed[:, 0::2]), into(stem + "gate_up_proj", slice(0, None, 2))),
        "ffn_up_exps.weight": (np.ascontiguousarray(transposed[:, 1::2]), into(stem + "gate_up_proj", slice(1, None, 2))),
        "ffn_down_exps.weight": (np.ascontiguousarray(down.transpose(0, 2, 1)), into(stem + "down_proj", slice(None))),
        "ffn_gate_exps.bias": (np.ascontiguousarray(bias[:, 0::2]), None),
        "ffn_up_exps.bias": (np.ascontiguousarray(bias[:, 1::2]), None),
    }  # fmt: skip


def _write_metadata(writer: gguf.GGUFWriter, config: dict, arch: str) -> None:
    # Glm4MoeModel counts its multi-token-prediction layers as blocks too
    writer.add_block_count(config["num_hidden_layers"] + (NUM_MTP if arch == "glm4moe" else 0))
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # gemma3's global layers'
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch in ("qwen3moe", "qwen2moe", "gpt-oss", "llama", "glm4moe"):
        experts = config.get("num_experts", config.get("num_local_experts", config.get("n_routed_experts")))
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch in ("qwen3moe", "qwen2moe", "glm4moe"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if arch == "glm4moe":  # TextModel's group counts, Glm4MoeModel's own keys
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
        partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
        writer.add_rope_dimension_count(int(head_dim * partial))
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
        writer.add_nextn_predict_layers(NUM_MTP)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    elif arch == "gpt-oss":
        writer.add_expert_feed_forward_length(config["intermediate_size"])
    if arch in ("gpt-oss", "gemma3"):
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma3":
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        # llama.cpp's own pattern is every sixth layer global; a tiny model's own, written out
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
    if arch == "phi3":  # Phi3MiniModel: int(partial_rotary_factor * hidden) // heads
        partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(partial * config["hidden_size"]) // config["num_attention_heads"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
        writer.add_rope_scaling_orig_ctx_len(
            rope.get("original_max_position_embeddings", config["max_position_embeddings"])
        )
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _write_vocab(writer: gguf.GGUFWriter, model_dir: Path, pre: str) -> None:
    """The tests' byte-level BPE as llama.cpp's _set_vocab_gpt2 writes one."""
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {added["content"] for added in tokenizer["added_tokens"] if added["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
