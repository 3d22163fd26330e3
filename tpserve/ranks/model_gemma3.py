"""Gemma 3 (text): the decoder of "Gemma 3 Technical Report" (Gemma Team, 2025) on one rank's pieces.

What it changes in the Llama-style decoder (tpserve/ranks/model.py), each where the report says:
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
  global layers (the attention kernels' SpanView.images, named by the engine from the media rows).
The sharding, products, KV pool and attention kernels are the shared ones: only the layer's shape
differs, so tp=2 == tp=1 and batched == solo hold as for every family.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tpserve.kernels.rope_scaling import RopeScaling
from tpserve.kernels.rotary import Rotary
from tpserve.ranks.model import PassPlan, PieceLayer, TPModel

# Before the attention, after it, before the MLP, after it
NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class Gemma3Model(TPModel):
    def __init__(self, config, weights, pieces, **options):
        super().__init__(config, weights, pieces, **options)
        gemma = config.gemma3
        # Every norm's weight w becomes its factor 1 + w once, in float32 as the reference's forward
        # computes it (and keeps it: the shared RMSNorm then scales before rounding to a narrower
        # dtype, as Gemma 3's does).
        for name, weight in self.replicated.items():
            if name.endswith("norm.weight"):
                self.replicated[name] = 1.0 + weight.float()
        self.local_rotary = Rotary(
            config.head_dim, gemma.local_theta, RopeScaling(), options["max_positions"], self.device
        )
        self.scale = gemma.query_pre_attn_scalar**-0.5
        self.activation = functools.partial(F.gelu, approximate="tanh")  # GeGLU
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=self.dtype)
        self.softcap = gemma.final_logit_softcapping
        # Gemma3ForConditionalGeneration: each image's tokens attend to each other (token_type_ids)
        self.images_see_each_other = config.vision is not None

    def _token_embeddings(self, token_ids, media_rows) -> torch.Tensor:
        """Scaled before the image features go in, which are not (as transformers' scatter). Each
        row has one nonzero share, so scaling before the all-reduce gives the bits of scaling after
        it; in float32 the product of two narrower numbers is exact, rounded once as theirs."""
        return super()._token_embeddings(token_ids, media_rows) * self.embed_scale.float()

    def _layer(self, index: int, pieces: list[PieceLayer], h, plan: PassPlan, kv) -> torch.Tensor:
        """Attention and MLP, each normed before and after, each added to the residual."""
        return self._normed_layer(index, pieces, h, plan, kv, NORMS)

    def _logits(self, last: torch.Tensor) -> torch.Tensor | None:
        logits = super()._logits(last)
        if logits is None or self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap
