"""A mixture-of-experts model's routing shape, read once from its config.json and validated.

Mixtral (every layer sparse, experts under `block_sparse_moe.experts.N.w1/w3/w2`) and Qwen3-MoE
(experts under `mlp.experts.N.gate_proj/up_proj/down_proj`, dense layers where `mlp_only_layers` or
`decoder_sparse_step` say so). Both route by a softmax over every expert, keep the top k, and
Mixtral (always) or Qwen3-MoE (where `norm_topk_prob`) renormalises the k weights to sum to one.
gpt-oss stores every layer's experts stacked (`mlp.experts.gate_up_proj` [E, hidden, 2I], gate and
up columns interleaved, `down_proj` [E, I, hidden], biases beside them; MXFP4 as `*_blocks` and
`*_scales`: tpserve/ranks/stacked_experts.py reads each expert's part under the names below); its router
(`mlp.router`, with a bias) keeps the k largest logits and softmaxes those, and its experts' GLU is
clamped (ClampedSwiglu).
GLM-4.5/4.6 (`Glm4MoeForCausalLM`, experts named as Qwen3-MoE's) routes by sigmoid scores instead
(GroupedSigmoidRouting: a correction bias steers the choice, grouped top-k, the weights scaled), adds
a shared expert (`mlp.shared_experts.*`, an always-on SwiGLU MLP) to every sparse layer's sum, and
keeps its first `first_k_dense_replace` layers dense ("GLM-4.5: Agentic, Reasoning, and Coding (ARC)
Foundation Models", Zhipu AI & Tsinghua, 2025; its partial rotary: tpserve/ranks/partial_rotary.py).
Its multi-token-prediction layers (`num_nextn_predict_layers`) are a draft model beside the decoder
and are not read.
Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE, Qwen2-57B-A14B) routes and names its experts as
Qwen3-MoE does, and adds a shared expert (`mlp.shared_expert.*`, `shared_expert_intermediate_size`
wide) whose output each token scales by sigmoid(`mlp.shared_expert_gate`(x)), a gate [1, hidden].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError

MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "glm4_moe")
_EXPERT_NAME = re.compile(
    r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.(\w+)\.(weight|bias)$"
)
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0  # transformers' GptOssConfig defaults
QWEN2_MOE_SHARED_SIZE = 5632  # transformers' Qwen2MoeConfig default shared_expert_intermediate_size


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert GLU: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


@dataclass(frozen=True)
class GroupedSigmoidRouting:
    """GLM-4.5's router: scores sigmoid(logits); the experts chosen by score + correction bias
    (`mlp.gate.e_score_correction_bias`), first the `topk_group` of `num_groups` groups whose two
    best such sums are largest, then the top k within them; the weights are the chosen experts' own
    scores, renormalised where the MoeConfig says, times `scale` (routed_scaling_factor)."""

    num_groups: int
    topk_group: int
    scale: float


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int  # k: the experts each token is routed to
    expert_size: int  # each expert's intermediate size
    normalize_top_k: bool  # the k chosen weights renormalised to sum to one
    sparse_layers: tuple[int, ...]  # layers whose MLP is the experts (the others are dense)
    prefix: str  # "mlp." (Qwen3-MoE) or "block_sparse_moe." (Mixtral)
    leaves: tuple[str, str, str]  # the gate, up and down projections' names
    router: str = "gate"  # the router's module name ("router": gpt-oss's)
    # gpt-oss: biases on the router and every expert projection, the top k logits softmaxed (not
    # the top k of a softmax over all), the clamped GLU; experts stacked in the checkpoint
    biased: bool = False
    softmax_top_logits: bool = False
    swiglu: ClampedSwiglu | None = None  # None: SwiGLU's silu(gate) * up
    stacked: bool = False  # every expert in one tensor a projection (tpserve/ranks/stacked_experts.py)
    grouped: GroupedSigmoidRouting | None = None  # GLM-4.5's routing (None: a softmax's)
    shared_size: int = 0  # the shared expert's intermediate size (GLM-4.5's, Qwen2-MoE's; 0: none)
    shared_stem: str = "shared_experts."  # its module's name ("shared_expert.": Qwen2-MoE's)
    shared_gate: bool = False  # its output scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE's)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def router_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.prefix}{self.router}.weight"  # [num_experts, hidden]

    def router_bias_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.prefix}{self.router}.bias"  # [num_experts] (biased only)

    def down_bias_name(self, layer: int) -> str:
        """Every expert's down bias [num_experts, hidden] (biased only): added once, after the
        pieces' partial sums are reduced, so it is whole on every rank."""
        return f"model.layers.{layer}.{self.prefix}experts.down_proj_bias"

    def correction_name(self, layer: int) -> str:
        """The router's score correction [num_experts] (GLM-4.5's, grouped only)."""
        return f"model.layers.{layer}.{self.prefix}{self.router}.e_score_correction_bias"

    def shared_names(self, layer: int) -> tuple[str, str, str]:
        """The shared expert's gate [S, hidden], up [S, hidden] and down [hidden, S] (shared_size S)."""
        stem = f"model.layers.{layer}.{self.prefix}{self.shared_stem}"
        return tuple(stem + leaf + ".weight" for leaf in self.leaves)

    def shared_gate_name(self, layer: int) -> str:
        """The shared expert's gate [1, hidden] (shared_gate only): one logit a token."""
        return f"model.layers.{layer}.{self.prefix}shared_expert_gate.weight"

    def expert_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Expert `expert`'s gate [I, hidden], up [I, hidden] and down [hidden, I] in layer `layer`."""
        stem = f"model.layers.{layer}.{self.prefix}experts.{expert}."
        return tuple(stem + leaf + ".weight" for leaf in self.leaves)

    def expert_bias_names(self, layer: int, expert: int) -> tuple[str, str]:
        """Expert `expert`'s gate and up biases [I] each (biased only)."""
        stem = f"model.layers.{layer}.{self.prefix}experts.{expert}."
        return tuple(stem + leaf + ".bias" for leaf in self.leaves[:2])

    def expert_shape(self, name: str, hidden_size: int) -> tuple[int, ...] | None:
        """An expert weight's (or bias's) shape, None where `name` is no expert's."""
        match = _EXPERT_NAME.match(name)
        if match is None:
            return None
        if match.group(2) == "bias":
            return (self.expert_size,)
        down = match.group(1) == self.leaves[2]
        return (hidden_size, self.expert_size) if down else (self.expert_size, hidden_size)


def parse_moe_config(raw: dict, family: str, num_layers: int, path: str | Path) -> MoeConfig | None:
    """The family's MoeConfig, None for a dense family."""
    if family not in MOE_FAMILIES:
        return None

    def count(key: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelFileError(path, f"{key!r} must be a positive integer, not {value!r}")
        return value

    if family != "qwen2_moe" and raw.get("shared_expert_intermediate_size"):
        raise ModelFileError(path, "a shared expert (shared_expert_intermediate_size) is not implemented")
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, GLM's is n_routed_experts
    num_experts = count(
        "num_experts", raw.get("num_experts", raw.get("num_local_experts", raw.get("n_routed_experts")))
    )
    top_k = count("num_experts_per_tok", raw.get("num_experts_per_tok"))
    if top_k > num_experts:
        raise ModelFileError(path, f"num_experts_per_tok {top_k} is more than the {num_experts} experts")
    if family == "gpt_oss":
        alpha, limit = raw.get("swiglu_alpha", GPT_OSS_ALPHA), raw.get("swiglu_limit", GPT_OSS_LIMIT)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (alpha, limit)):
            raise ModelFileError(
                path, f"swiglu_alpha {alpha!r} and swiglu_limit {limit!r} must be positive numbers"
            )
        return MoeConfig(
            num_experts, top_k, count("intermediate_size", raw.get("intermediate_size")), False,
            tuple(range(num_layers)), "mlp.", ("gate_proj", "up_proj", "down_proj"), router="router",
            biased=True, softmax_top_logits=True, swiglu=ClampedSwiglu(float(alpha), float(limit)),
            stacked=True,
        )  # fmt: skip
    if family == "glm4_moe":
        return _parse_glm4_moe(raw, num_experts, top_k, num_layers, count, path)
    if family == "mixtral":
        return MoeConfig(
            num_experts, top_k, count("intermediate_size", raw.get("intermediate_size")), True,
            tuple(range(num_layers)), "block_sparse_moe.", ("w1", "w3", "w2"),
        )  # fmt: skip
    # Qwen3-MoE and Qwen2-MoE: dense where mlp_only_layers or decoder_sparse_step say so
    step = count("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
    dense = raw.get("mlp_only_layers") or ()
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense):
        raise ModelFileError(path, f"'mlp_only_layers' must name layers 0..{num_layers - 1}, not {dense!r}")
    sparse = tuple(i for i in range(num_layers) if i not in set(dense) and (i + 1) % step == 0)
    shared = {}
    if family == "qwen2_moe":  # 0 wide: no shared expert (transformers' would add zeros)
        size = raw.get("shared_expert_intermediate_size", QWEN2_MOE_SHARED_SIZE)
        size = 0 if size == 0 else count("shared_expert_intermediate_size", size)
        shared = {"shared_size": size, "shared_stem": "shared_expert.", "shared_gate": bool(size)}
    return MoeConfig(
        num_experts, top_k, count("moe_intermediate_size", raw.get("moe_intermediate_size")),
        bool(raw.get("norm_topk_prob", False)), sparse, "mlp.", ("gate_proj", "up_proj", "down_proj"),
        **shared,
    )  # fmt: skip


def _parse_glm4_moe(raw: dict, num_experts: int, top_k: int, num_layers: int, count, path) -> MoeConfig:
    """GLM-4.5's routing, shared expert and dense first layers, refusing shapes its router cannot take."""
    # DeepSeek-style keys some GLM configs carry: only GLM-4.5's own choice is computed
    for key, computed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if raw.get(key, computed) != computed:
            raise ModelFileError(path, f"Glm4MoeForCausalLM: {key} {raw[key]!r} is not implemented")
    num_groups = count("n_group", raw.get("n_group", 1))
    topk_group = count("topk_group", raw.get("topk_group", 1))
    scale = raw.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ModelFileError(path, f"'routed_scaling_factor' must be a positive number, not {scale!r}")
    if num_experts % num_groups or num_experts // num_groups < 2:
        # a group's score is the sum of its two best experts'
        raise ModelFileError(
            path, f"{num_experts} experts do not split into {num_groups} groups of 2 or more"
        )
    if topk_group > num_groups or top_k > topk_group * (num_experts // num_groups):
        raise ModelFileError(
            path, f"top {top_k} experts of the best {topk_group} of {num_groups} groups cannot be chosen"
        )
    size = count("moe_intermediate_size", raw.get("moe_intermediate_size"))
    num_shared = raw.get("n_shared_experts", 1)
    num_shared = 0 if num_shared in (0, None) else count("n_shared_experts", num_shared)
    first_sparse = raw.get("first_k_dense_replace", 1)
    if isinstance(first_sparse, bool) or not isinstance(first_sparse, int) or first_sparse < 0:
        raise ModelFileError(path, f"'first_k_dense_replace' must be a count, not {first_sparse!r}")
    return MoeConfig(
        num_experts, top_k, size, bool(raw.get("norm_topk_prob", True)),
        tuple(range(first_sparse, num_layers)), "mlp.", ("gate_proj", "up_proj", "down_proj"),
        grouped=GroupedSigmoidRouting(num_groups, topk_group, float(scale)), shared_size=size * num_shared,
    )  # fmt: skip
