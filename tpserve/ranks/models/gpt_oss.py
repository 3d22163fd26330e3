"""gpt-oss: the decoder of OpenAI's "gpt-oss-120b & gpt-oss-20b Model Card" (2025) on one rank's pieces.

What it changes in the Llama-style decoder (tpserve/ranks/models/llama.py), each where the model card says:
- attention alternates between a banded window (`sliding_window`, 128 tokens) and the full causal
  context, layer by layer (`layer_types`); every head has a learned sink, a logit that joins each
  softmax's denominator and attends to nothing (every attention kernel takes them);
- biases on q, k, v and o; o's is added once, after the pieces' partial sums are reduced;
- every MLP a mixture of experts: a router with a bias keeps each token's k largest logits and
  softmaxes them (tpserve/ranks/moe.py); each expert a GLU with biases whose gate is clamped above and up
  clamped both ways, (up + 1) * gate * sigmoid(1.702 gate) (tpserve/kernels/moe.py); the experts' down
  biases, weighted by the route, are added once after the reduce, as o's is
  (tpserve/ranks/layers/sparse_moe.py);
- YaRN-scaled rotary positions (tpserve/kernels/rotary.py), its correction range not truncated.
The experts come stacked in the checkpoint, in float or MXFP4 (tpserve/ranks/stacked_experts.py); each
piece holds every expert's slice of the intermediate dimension, so tp=2 == tp=1 and batched ==
solo hold as for the other mixtures of experts.
"""

from __future__ import annotations

from tpserve.ranks.layers.attention import Attention
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.models.llama import layer_window, qk_norms
from tpserve.ranks.models.moe import MoeModel


class GptOssModel(MoeModel):
    def self_attention(self, shard: Shard, index: int) -> Attention:
        config = shard.config
        o_bias = shard.replicated(shard.layer_name(index, "self_attn.o_proj.bias")) if config.o_bias else None
        return Attention(
            shard,
            index,
            scale=config.head_dim**-0.5,
            window=layer_window(shard, index),
            qk_norms=qk_norms(shard, index),
            sinks=shard.replicated(shard.layer_name(index, "self_attn.sinks")),  # [Hq]
            o_bias=o_bias,
        )
