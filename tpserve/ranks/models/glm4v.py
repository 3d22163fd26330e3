"""GLM-4.1V's text model (transformers' Glm4vTextModel) on one rank's pieces: the Llama-style decoder
(tpserve/ranks/models/llama.py) with a norm on the attention's output and one on the MLP's, each before
its residual add, beside the usual pre-norms. Its interleaved partial rotary is served by the shared
kernels (q's and k's dims reordered at load: tpserve/ranks/partial_rotary.py), its positions multimodal
(tpserve/ranks/mrope.py), so tp=2 == tp=1 and batched == solo hold as for every family.
"""

from __future__ import annotations

from tpserve.ranks.layers.decoder import SandwichDecoderLayer
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.models.llama import LlamaModel, layer_norm

# Before the attention, after it, before the MLP, after it
NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4vModel(LlamaModel):
    def decoder_layer(self, shard: Shard, index: int) -> SandwichDecoderLayer:
        norms = tuple(layer_norm(shard, index, name) for name in NORMS)
        return SandwichDecoderLayer(self.self_attention(shard, index), self.mlp(shard, index), norms)
