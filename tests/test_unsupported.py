"""A checkpoint that asks for math tpserve does not compute is refused by name, not served wrong."""

from __future__ import annotations

import pytest
import torch
from tiny_models import BASE, write_tiny_model

from tpserve.kernels.rope_scaling import RopeScaling
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.loader import load_rank_model
from tpserve.ranks.model_config import parse_model_config
from tpserve.ranks.unsupported import check_served_context


def config_of(architecture: str, **fields) -> dict:
    return {**BASE, "vocab_size": 320, "architectures": [architecture], **fields}


QWEN3_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
GEMMA3 = {
    "hidden_activation": "gelu_pytorch_tanh",
    "head_dim": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
}
GPT_OSS = {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 8}

REFUSED = {
    "mla": (
        config_of("LlamaForCausalLM", kv_lora_rank=512),
        "multi-head latent attention (MLA, kv_lora_rank 512)",
    ),
    "deepseek": (
        config_of("DeepseekV3ForCausalLM"),
        "DeepseekV3ForCausalLM is not supported: multi-head latent",
    ),
    # every key only an MLA config carries, in whatever family's config it turns up
    "mla-q-lora": (
        config_of("Qwen3MoeForCausalLM", **QWEN3_MOE, q_lora_rank=1536),
        "multi-head latent attention (MLA, q_lora_rank 1536)",
    ),
    "mla-rope-dims": (
        config_of("MistralForCausalLM", qk_rope_head_dim=64),
        "multi-head latent attention (MLA, qk_rope_head_dim 64)",
    ),
    "glm-4.7-flash": (
        config_of("Glm4MoeLiteForCausalLM", kv_lora_rank=512),
        "Glm4MoeLiteForCausalLM is not supported: multi-head latent attention (MLA) not implemented",
    ),
    "deepseek-v3.2": (
        config_of("DeepseekV32ForCausalLM"),
        "DeepseekV32ForCausalLM is not supported: multi-head latent attention (MLA) and DeepSeek's sparse",
    ),
    "kimi-linear": (
        config_of("KimiLinearForCausalLM"),
        "KimiLinearForCausalLM is not supported: hybrid linear-attention layers",
    ),
    "qwen3-next": (
        config_of("Qwen3NextForCausalLM"),
        "Qwen3NextForCausalLM is not supported: hybrid linear-attention",
    ),
    "qwen3.5": (
        config_of("Qwen3_5ForCausalLM"),
        "hybrid linear-attention (Gated DeltaNet) layers not implemented",
    ),
    "unknown": (config_of("FooForCausalLM"), "unsupported architecture ['FooForCausalLM'] (supported: Llama"),
    "linear-layers": (
        config_of("Qwen3ForCausalLM", layer_types=["linear_attention", "full_attention"]),
        "Qwen3ForCausalLM: layer_types ['linear_attention'] is not implemented",
    ),
    "softcap": (
        config_of("LlamaForCausalLM", final_logit_softcapping=30.0),
        "final_logit_softcapping 30.0 is not implemented",
    ),
    "attention-softcap": (
        config_of("GptOssForCausalLM", **GPT_OSS, attn_logit_softcapping=50.0),
        "GptOssForCausalLM: attn_logit_softcapping 50.0 is not implemented",
    ),
    # Gemma 3 computes its final soft-capping, not Gemma 2's on the attention scores
    "gemma3-attention-softcap": (
        config_of("Gemma3ForCausalLM", **GEMMA3, attn_logit_softcapping=50.0),
        "Gemma3ForCausalLM: attn_logit_softcapping 50.0 is not implemented",
    ),
    "gemma3-bidirectional": (
        config_of("Gemma3ForCausalLM", **GEMMA3, use_bidirectional_attention=True),
        "Gemma3: use_bidirectional_attention is not implemented",
    ),
    "gemma3-local-rope": (
        config_of(
            "Gemma3ForCausalLM",
            **GEMMA3,
            rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        ),
        "Gemma3: local rope type 'linear' is not implemented",
    ),
    "gemma3-partial-rotary": (
        config_of(
            "Gemma3ForCausalLM",
            **GEMMA3,
            rope_parameters={"full_attention": {"rope_theta": 1e6, "partial_rotary_factor": 0.5}},
        ),
        "partial rotary embedding (full_attention partial_rotary_factor 0.5) is not implemented",
    ),
    "gemma3-activation": (
        config_of("Gemma3ForCausalLM", **(GEMMA3 | {"hidden_activation": "silu"})),
        "hidden_activation 'silu' (only GeGLU's gelu_pytorch_tanh is)",
    ),
    # layer_types where transformers' model reads none (its windows follow the family's rule)
    "mistral-layer-types": (
        config_of(
            "MistralForCausalLM", sliding_window=16, layer_types=["full_attention", "sliding_attention"]
        ),
        "mistral: layer_types ['full_attention', 'sliding_attention'] is not implemented (transformers' "
        "model reads none; by the family's own rule the sliding layers are [0, 1])",
    ),
    "llama-layer-types": (
        config_of("LlamaForCausalLM", sliding_window=16, layer_types=["sliding_attention"] * 2),
        "llama: layer_types ['sliding_attention', 'sliding_attention'] is not implemented",
    ),
    # transformers 4 slid Qwen3-MoE's layers from max_window_layers on, 5 slides every one
    "qwen3-moe-window": (
        config_of("Qwen3MoeForCausalLM", **QWEN3_MOE, use_sliding_window=True, sliding_window=8),
        "Qwen3MoeForCausalLM: use_sliding_window with max_window_layers 28 is not implemented",
    ),
    "gelu": (config_of("MistralForCausalLM", hidden_act="gelu"), "hidden_act 'gelu' (only SwiGLU's silu is)"),
    "mlp-bias": (config_of("LlamaForCausalLM", mlp_bias=True), "mlp_bias (biases on gate, up and down)"),
    "o-bias": (
        config_of("LlamaForCausalLM", attention_bias=True),
        "attention_bias (transformers puts a bias on o_proj too) is not implemented",
    ),
    "partial-rotary": (
        config_of("LlamaForCausalLM", partial_rotary_factor=0.75),
        "partial rotary embedding (partial_rotary_factor 0.75) is not implemented",
    ),
    "shared-expert": (
        config_of(
            "Qwen3MoeForCausalLM",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        "a shared expert (shared_expert_intermediate_size) is not implemented",
    ),  # fmt: skip
    "top-k": (
        config_of("MixtralForCausalLM", num_local_experts=2, num_experts_per_tok=3),
        "num_experts_per_tok 3 is more than the 2 experts",
    ),
    "dynamic-rope": (
        config_of("LlamaForCausalLM", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "unsupported rope scaling 'dynamic'",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unimplemented_features_are_refused_by_name(case):
    raw, message = REFUSED[case]
    with pytest.raises(ModelFileError) as refused:
        parse_model_config(raw)
    assert message in str(refused.value)


WINDOWS = {
    # Mistral-7B-v0.1: a sliding_window set is a window in force.
    "mistral": (config_of("MistralForCausalLM", sliding_window=16), 16),
    # Qwen2 with the flag on: layers from max_window_layers on slide.
    "qwen2-on": (
        config_of("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=32, max_window_layers=1),
        32,
    ),
    # Qwen2.5 carries a window with the flag off: none in force.
    "qwen2.5": (config_of("Qwen2ForCausalLM", use_sliding_window=False, sliding_window=32768), None),
    # transformers 5 writes layer_types: they say which layers slide.
    "qwen3-layers": (
        config_of("Qwen3ForCausalLM", layer_types=["full_attention", "sliding_attention"], sliding_window=8),
        8,
    ),
    "llama": (config_of("LlamaForCausalLM", sliding_window=16), None),  # Llama has no window
}


@pytest.mark.parametrize("case", sorted(WINDOWS))
def test_a_live_sliding_window_is_read_from_the_config(case):
    raw, window = WINDOWS[case]
    assert parse_model_config(raw).sliding_window == window


def test_a_window_in_force_is_logged_naming_model_and_window():
    note = check_served_context("MistralForCausalLM", 16, RopeScaling(), 64, "/models/m")
    assert note == (
        "MistralForCausalLM attends within a sliding window of 16 tokens on its sliding layers (a context "
        "of 64): keys behind every window are not read"
    )
    note = check_served_context("MistralForCausalLM", 4096, RopeScaling(), 4096, "/models/m")
    assert note == (
        "MistralForCausalLM's sliding window of 4096 tokens never binds at a context of 4096: "
        "full attention is exact"
    )
    assert check_served_context("MistralForCausalLM", None, RopeScaling(), 1 << 20, "/models/m") is None


def test_a_windowed_model_loads_for_a_context_past_its_window(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", "mistral", overrides={"sliding_window": 16})
    model = load_rank_model(model_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=64)
    assert model.config.sliding_window == 16 and model.config.windows == (16, 16)


LAYER_WINDOWS = {
    "mistral": (config_of("MistralForCausalLM", sliding_window=16), (16, 16)),
    "qwen2-on": (
        config_of("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=32, max_window_layers=1),
        (0, 32),
    ),
    "qwen2.5": (config_of("Qwen2ForCausalLM", use_sliding_window=False, sliding_window=32768), ()),
    "qwen3-layers": (
        config_of("Qwen3ForCausalLM", layer_types=["full_attention", "sliding_attention"], sliding_window=8),
        (0, 8),
    ),
    # gpt-oss without layer_types: transformers' GptOssConfig slides the even layers
    "gpt-oss-pattern": (
        config_of("GptOssForCausalLM", **(GPT_OSS | {"num_hidden_layers": 4})),
        (8, 0, 8, 0),
    ),
    # Qwen3-MoE with every layer sliding (max_window_layers 0): transformers 4 and 5 agree
    "qwen3-moe-every-layer": (
        config_of(
            "Qwen3MoeForCausalLM", **QWEN3_MOE, use_sliding_window=True, sliding_window=8, max_window_layers=0
        ),
        (8, 8),
    ),
    # layer_types that say what the family's own rule says
    "mistral-layer-types": (
        config_of("MistralForCausalLM", sliding_window=16, layer_types=["sliding_attention"] * 2),
        (16, 16),
    ),
}


@pytest.mark.parametrize("case", sorted(LAYER_WINDOWS))
def test_each_layers_window_is_read_from_the_config(case):
    raw, windows = LAYER_WINDOWS[case]
    assert parse_model_config(raw).windows == windows


def test_layer_types_of_another_length_than_the_layers_are_refused():
    raw = config_of("Qwen3ForCausalLM", layer_types=["sliding_attention"], sliding_window=8)
    with pytest.raises(ModelFileError, match="layer_types names 1 layers of 2"):
        parse_model_config(raw)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"layer_types": ["full_attention", "full_attention"]}, "mistral: layer_types ['full_attention',"),
        ({"q_lora_rank": 768}, "multi-head latent attention (MLA, q_lora_rank 768)"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not implemented"),
    ],
)
def test_a_checkpoint_asking_for_them_is_refused_at_load_by_the_keys_name(tmp_path, fields, message):
    # the rank's start-up reads config.json through load_model_config, as load_rank_model does here
    model_dir = write_tiny_model(tmp_path / "m", "mistral", overrides={"sliding_window": 16, **fields})
    with pytest.raises(ModelFileError) as refused:
        load_rank_model(model_dir, tp_rank=0, tp_size=1, dtype=torch.float32, max_positions=64)
    assert message in str(refused.value) and str(model_dir) in str(refused.value)
