"""The Llama-style decoder with a mixture of experts in place of the MLP (tpserve/ranks/layers/sparse_moe.py):
Mixtral ("Mixtral of Experts", Jiang et al., 2024: top-2 of 8 SwiGLU experts, softmax then top-k),
Qwen3-MoE (top-k of the softmax, renormalised), Qwen2-MoE (and a shared expert gated by a sigmoid),
GLM-4.5/4.6 (grouped sigmoid routing with a correction bias, a shared expert, its first layers dense,
a partial rotary) and GLM-4.5V's text model. The routing's shape is the config's
(tpserve/ranks/moe_config.py); a layer the family keeps dense has the dense MLP.
"""

from __future__ import annotations

from tpserve.ranks.layers.mlp import DenseMLP
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.layers.sparse_moe import SparseMoE
from tpserve.ranks.models.llama import LlamaModel


class MoeModel(LlamaModel):
    def mlp(self, shard: Shard, index: int) -> DenseMLP | SparseMoE:
        sparse = shard.config.moe.is_sparse(index)
        return SparseMoE(shard, index) if sparse else DenseMLP(shard, index)
