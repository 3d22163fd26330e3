"""GLM-4.5/4.6 (tpserve/ranks/moe_config.py, tpserve/ranks/partial_rotary.py): what its config says
(dense first layers, grouped routing, shared experts, partial rotary) and what it refuses, and its router worked by hand. Against
transformers' own Glm4MoeForCausalLM, tp=2 against tp=1, batched against solo, chunks and int4: the
glm4-moe variants of tests/test_moe.py; in bfloat16: tests/test_bfloat16_families.py; through the
daemon: tests/test_moe_daemon.py."""

from __future__ import annotations

import pytest
import torch
from tiny_hf_models import write_hf_model

from tpserve.kernels.moe import route_grouped_sigmoid
from tpserve.ranks.errors import ModelFileError
from tpserve.ranks.model_config import load_model_config, parse_model_config


def test_glm4_moe_reads_its_dense_layers_routing_shared_experts_and_rotary(tmp_path):
    config = load_model_config(write_hf_model(tmp_path / "m", "glm4-moe"))
    moe = config.moe
    assert config.family == "glm4_moe" and config.qk_norm and config.qkv_bias and not config.o_bias
    assert moe.sparse_layers == (1, 2) and moe.num_experts == 8 and moe.num_experts_per_tok == 3
    assert (moe.grouped.num_groups, moe.grouped.topk_group, moe.grouped.scale) == (4, 2, 2.5)
    assert moe.expert_size == 18 and moe.shared_size == 36 and moe.normalize_top_k
    assert config.rotary_dim == 8  # transformers' default partial_rotary_factor for GLM: half


def test_routing_chooses_by_corrected_scores_within_the_best_groups_and_weighs_by_plain_ones():
    # 4 experts in 2 groups: group 1 (experts 2, 3) wins only by the correction, and so does expert 3
    logits = torch.tensor([[2.0, 1.0, 0.0, -0.5]])
    correction = torch.tensor([0.0, 0.0, 0.6, 0.9])
    weights, experts = route_grouped_sigmoid(logits, correction, 2, 2, 1, True, 2.0)
    assert experts.tolist() == [[3, 2]]
    scores = logits.sigmoid()[0, [3, 2]]
    torch.testing.assert_close(weights[0], 2.0 * scores / (scores.sum() + 1e-20))


GLM = {
    "architectures": ["Glm4MoeForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}
REFUSED = {
    "groups": ({"n_group": 3}, "8 experts do not split into 3 groups of 2 or more"),
    "group-of-one": ({"n_group": 8, "topk_group": 2}, "8 experts do not split into 8 groups of 2 or more"),
    "top-k": (
        {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
        "top 3 experts of the best 1 of 4 groups cannot be chosen",
    ),
    "odd-rotary": ({"partial_rotary_factor": 0.3125}, "partial rotary over 5 of 16 dims: not an even count"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    "scoring": ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not implemented"),
    "layer-freq": ({"moe_layer_freq": 2}, "moe_layer_freq 2 is not implemented"),
    "softcap": ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not implemented"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_glm4_moe_shapes_its_router_or_rotary_cannot_take_are_refused_by_name(case):
    fields, message = REFUSED[case]
    with pytest.raises(ModelFileError) as refused:
        parse_model_config(GLM | fields)
    assert message in str(refused.value)
