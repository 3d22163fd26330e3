"""gpt-oss: the decoder of OpenAI's "gpt-oss-120b & gpt-oss-20b Model Card" (2025) on one rank's pieces.

What it changes in the Llama-style decoder (tpserve/ranks/model.py), each where the model card says:
- attention alternates between a banded window (`sliding_window`, 128 tokens) and the full causal
  context, layer by layer (`layer_types`); every head has a learned sink, a logit that joins each
  softmax's denominator and attends to nothing (every attention kernel takes them);
- biases on q, k, v and o; o's is added once, after the pieces' partial sums are reduced;
- every MLP a mixture of experts: a router with a bias keeps each token's k largest logits and
  softmaxes them (tpserve/ranks/moe.py); each expert a GLU with biases whose gate is clamped above and up
  clamped both ways, (up + 1) * gate * sigmoid(1.702 gate) (tpserve/kernels/moe.py); the experts' down
  biases, weighted by the route, are added once after the reduce, as o's is;
- YaRN-scaled rotary positions (tpserve/kernels/rotary.py), its correction range not truncated.
The experts come stacked in the checkpoint, in float or MXFP4 (tpserve/ranks/stacked_experts.py); each
piece holds every expert's slice of the intermediate dimension, so tp=2 == tp=1 and batched ==
solo hold as for the other mixtures of experts.
"""

from __future__ import annotations

from tpserve.kernels.moe import routed_bias
from tpserve.kernels.norms import rms_norm
from tpserve.ranks.model import PassPlan, PieceLayer, TPModel


class GptOssModel(TPModel):
    def __init__(self, config, weights, pieces, **options):
        super().__init__(config, weights, pieces, **options)
        group = config.num_queries_per_kv
        self.layer_sinks = [
            [
                self.replicated[f"model.layers.{index}.self_attn.sinks"][start * group : end * group]
                for start, end in (piece.kv_heads for piece in pieces)
            ]
            for index in range(config.num_layers)
        ]

    def _layer(self, index: int, pieces: list[PieceLayer], h, plan: PassPlan, kv):
        """Pre-norm attention and experts, each with its once-added biases, added to the residual."""
        cfg, replicated, prefix = self.config, self.replicated, f"model.layers.{index}."
        x = rms_norm(h, replicated[prefix + "input_layernorm.weight"], cfg.rms_norm_eps)
        attended = self._attention_block(index, pieces, x, plan, kv)  # [rows, hidden], reduced
        if cfg.o_bias:
            attended = attended + replicated[prefix + "self_attn.o_proj.bias"]
        h = h + attended
        x = rms_norm(h, replicated[prefix + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        return h + self._experts_block(index, pieces, x, plan)

    def _experts_block(self, index: int, pieces: list[PieceLayer], x, plan: PassPlan):
        """The experts' sum over the pieces, reduced, plus the routed down biases: [rows, hidden]."""
        routes = self.routers[index].route(x, plan.num_tokens, self.row_tile)  # [T, k] each
        partial = self._sum_pieces(
            (layer.experts.forward(x, routes, plan.num_tokens, self.row_tile) for layer in pieces), x
        )
        down_biases = self.replicated[self.config.moe.down_bias_name(index)]
        biases = routed_bias(routes.weights, routes.experts, down_biases)  # [T, hidden]
        out = self._reduce(partial)
        out[: plan.num_tokens] += biases.to(out.dtype)  # (padding rows: none routed)
        return out
