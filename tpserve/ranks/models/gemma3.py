"""Gemma 3 (text): the decoder of "Gemma 3 Technical Report" (Gemma Team, 2025) on one rank's pieces.

What it changes in the Llama-style decoder (tpserve/ranks/models/llama.py), each where the report says:
- local and global layers interleaved (five local to one global in the released models, config
  `layer_types`): a local layer attends within a sliding window (`sliding_window`, 1024 tokens)
  and rotates by a base of 10k, a global one sees the whole context with a base of 1M (and, in
  the larger models, a linear scaling of its positions);
- every norm an RMSNorm scaling by (1 + w) (the weights are stored around zero), around the
  attention and the MLP both before and after ("pre-norm and post-norm"), and on q and k (QK-norm,
  replacing Gemma 2's soft-capping of attention scores);
- GeGLU: the MLP's gate through the tanh-approximated GELU;
- the embeddings scaled by sqrt(hidden_size); attention scaled by query_pre_attn_scalar^-1/2;
  logits soft-capped as cap * tanh(logits / cap) where the config sets final_logit_softcapping;
- with images (Gemma3ForConditionalGeneration), an image's tokens see each other, in local and
  global layers (the attention kernels' SpanView.images, named by the engine from the media rows),
  and the image features go in unscaled.
The sharding, products, KV pool and attention kernels are the shared ones: only the layer's shape
differs, so tp=2 == tp=1 and batched == solo hold as for every family.
"""

from __future__ import annotations

import functools

import torch.nn.functional as F

from tpserve.kernels.rope_scaling import RopeScaling
from tpserve.kernels.rotary import Rotary
from tpserve.ranks.layers.attention import Attention
from tpserve.ranks.layers.decoder import SandwichDecoderLayer
from tpserve.ranks.layers.mlp import DenseMLP
from tpserve.ranks.layers.norm import RMSNorm
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.layers.vocab import VocabEmbedding, VocabHead
from tpserve.ranks.model import TPModel
from tpserve.ranks.models.llama import layer_norm, layer_window, qk_norms

# Before the attention, after it, before the MLP, after it
NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
GEGLU = functools.partial(F.gelu, approximate="tanh")


class Gemma3Model(TPModel):
    def build(self, shard: Shard):
        config, gemma = shard.config, shard.config.gemma3
        self.local_rotary = Rotary(
            config.head_dim, gemma.local_theta, RopeScaling(), self.max_positions, self.device
        )
        # Gemma3ForConditionalGeneration: each image's tokens attend to each other (token_type_ids)
        self.images_see_each_other = config.vision is not None
        head = VocabHead(shard, softcap=gemma.final_logit_softcapping)
        embed = VocabEmbedding(shard, head, scale=config.hidden_size**0.5)
        layers = [self.decoder_layer(shard, index) for index in range(config.num_layers)]
        final_norm = RMSNorm(shard.replicated("model.norm.weight"), config.rms_norm_eps, plus_one=True)
        return embed, layers, final_norm, head

    def decoder_layer(self, shard: Shard, index: int) -> SandwichDecoderLayer:
        config, window = shard.config, layer_window(shard, index)
        attention = Attention(
            shard,
            index,
            scale=config.gemma3.query_pre_attn_scalar**-0.5,
            window=window,
            local_rotary=bool(window),  # a local layer's base is its own
            qk_norms=qk_norms(shard, index, plus_one=True),
        )
        norms = tuple(layer_norm(shard, index, name, plus_one=True) for name in NORMS)
        return SandwichDecoderLayer(attention, DenseMLP(shard, index, activation=GEGLU), norms)
