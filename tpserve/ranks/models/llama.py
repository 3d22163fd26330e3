"""The Llama-style decoder ("LLaMA: Open and Efficient Foundation Language Models", Touvron et al.,
2023) on one rank's pieces, and the families that are it with other options: Mistral (a sliding
window), Qwen2 (q/k/v biases, Qwen's sliding layers), Qwen3 (q and k normed per head), Phi-3/Phi-4
(q/k/v and gate/up stored fused, split on load: tpserve/ranks/fused_tensors.py; Phi-4-mini's partial
rotary), and the text models of LLaVA, Idefics3, SmolVLM and Qwen-VL (a multimodal rotary).

Every layer: h + attention(RMSNorm(h)), then h + SwiGLU MLP(RMSNorm(h)); rotary positions; grouped
KV heads. The vocab-parallel embedding and head, the final RMSNorm.
"""

from __future__ import annotations

from tpserve.ranks.layers.attention import Attention
from tpserve.ranks.layers.decoder import DecoderLayer
from tpserve.ranks.layers.mlp import DenseMLP
from tpserve.ranks.layers.norm import RMSNorm
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.layers.sparse_moe import SparseMoE
from tpserve.ranks.layers.vocab import VocabEmbedding, VocabHead
from tpserve.ranks.model import TPModel


class LlamaModel(TPModel):
    def build(self, shard: Shard):
        head = VocabHead(shard)
        layers = [self.decoder_layer(shard, index) for index in range(shard.config.num_layers)]
        final_norm = RMSNorm(shard.replicated("model.norm.weight"), shard.config.rms_norm_eps)
        return VocabEmbedding(shard, head), layers, final_norm, head

    def decoder_layer(self, shard: Shard, index: int) -> DecoderLayer:
        return DecoderLayer(
            self.self_attention(shard, index),
            self.mlp(shard, index),
            layer_norm(shard, index, "input_layernorm"),
            layer_norm(shard, index, "post_attention_layernorm"),
        )

    def self_attention(self, shard: Shard, index: int) -> Attention:
        return Attention(
            shard,
            index,
            scale=shard.config.head_dim**-0.5,
            window=layer_window(shard, index),
            qk_norms=qk_norms(shard, index),
        )

    def mlp(self, shard: Shard, index: int) -> DenseMLP | SparseMoE:
        return DenseMLP(shard, index)


def layer_norm(shard: Shard, index: int, name: str, plus_one: bool = False) -> RMSNorm:
    """Layer `index`'s norm `name` (input_layernorm, ...)."""
    weight = shard.replicated(shard.layer_name(index, name + ".weight"))
    return RMSNorm(weight, shard.config.rms_norm_eps, plus_one=plus_one)


def qk_norms(shard: Shard, index: int, plus_one: bool = False) -> tuple[RMSNorm, RMSNorm] | None:
    """Layer `index`'s q and k norms where the family has them (config qk_norm), else None."""
    if not shard.config.qk_norm:
        return None
    return tuple(layer_norm(shard, index, f"self_attn.{n}_norm", plus_one) for n in "qk")


def layer_window(shard: Shard, index: int) -> int:
    """Layer `index`'s sliding window (0: it sees every earlier token)."""
    windows = shard.config.windows
    return windows[index] if windows else 0
