"""GLM-4.1V's text model (transformers' Glm4vTextModel) on one rank's pieces: the Llama-style decoder
(tpserve/ranks/model.py) with a norm on the attention's output and one on the MLP's, each before its
residual add, beside the usual pre-norms. Its interleaved partial rotary is served by the shared
kernels (q's and k's dims reordered at load: tpserve/ranks/partial_rotary.py), its positions multimodal
(tpserve/ranks/mrope.py), so tp=2 == tp=1 and batched == solo hold as for every family.
"""

from __future__ import annotations

import torch

from tpserve.ranks.model import PassPlan, PieceLayer, TPModel

# Before the attention, after it, before the MLP, after it
NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4vModel(TPModel):
    def _layer(self, index: int, pieces: list[PieceLayer], h, plan: PassPlan, kv) -> torch.Tensor:
        """Attention and MLP, each normed before and after, each added to the residual."""
        return self._normed_layer(index, pieces, h, plan, kv, NORMS)
