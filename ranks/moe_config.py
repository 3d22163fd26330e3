"""A mixture-of-experts model's routing shape, read once from its config.json and validated.

Mixtral (every layer sparse, experts under `block_sparse_moe.experts.N.w1/w3/w2`) and Qwen3-MoE
(experts under `mlp.experts.N.gate_proj/up_proj/down_proj`, dense layers where `mlp_only_layers` or
`decoder_sparse_step` say so). Both route by a softmax over every expert, keep the top k, and
Mixtral (always) or Qwen3-MoE (where `norm_topk_prob`) renormalises the k weights to sum to one.
gpt-oss stores every layer's experts stacked (`mlp.experts.gate_up_proj` [E, hidden, 2I], gate and
up columns interleaved, `down_proj` [E, I, hidden], biases beside them; MXFP4 as `*_blocks` and
`*_scales`: ranks/stacked_experts.py reads each expert's part under the names below); its router
(`mlp.router`, with a bias) keeps the k largest logits and softmaxes those, and its experts' GLU is
clamped (ClampedSwiglu).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tpserve.ranks.errors import ModelFileError

MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
_EXPERT_NAME = re.compile(
    r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.(\w+)\.(weight|bias)$"
)
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0  # transformers' GptOssConfig defaults


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert GLU: gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float


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
    stacked: bool = False  # every expert in one tensor a projection (ranks/stacked_experts.py)

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

    if raw.get("shared_expert_intermediate_size"):
        raise ModelFileError(path, "a shared expert (shared_expert_intermediate_size) is not implemented")
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    num_experts = count("num_experts", raw.get("num_experts", raw.get("num_local_experts")))
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
    if family == "mixtral":
        return MoeConfig(
            num_experts, top_k, count("intermediate_size", raw.get("intermediate_size")), True,
            tuple(range(num_layers)), "block_sparse_moe.", ("w1", "w3", "w2"),
        )  # fmt: skip
    step = count("decoder_sparse_step", raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoeConfig(
        num_experts, top_k, count("moe_intermediate_size", raw.get("moe_intermediate_size")),
        bool(raw.get("norm_topk_prob", False)), sparse, "mlp.", ("gate_proj", "up_proj", "down_proj"),
    )  # fmt: skip
