"""GLM-4.1V's text model (transformers' Glm4vTextModel) on one rank's pieces: the Llama-style decoder
(tpserve/ranks/model.py) with a norm on the attention's output and one on the MLP's, each before its
residual add, beside the usual pre-norms. Its interleaved partial rotary is served by the shared
kernels (q's and k's dims reordered at load: tpserve/ranks/partial_rotary.py), its positions multimodal
(tpserve/ranks/mrope.py), so tp=2 == tp=1 and batched == solo hold as for every family.
"""

from __future__ import annotations

import torch

from tpserve.kernels.norms import rms_norm
from tpserve.ranks.model import PassPlan, PieceLayer, TPModel


class Glm4vModel(TPModel):
    def _layer(self, index: int, pieces: list[PieceLayer], h, plan: PassPlan, kv) -> torch.Tensor:
        """Attention and MLP, each normed before and after, each added to the residual."""

        def norm(name: str, x: torch.Tensor) -> torch.Tensor:
            weight = self.replicated[f"model.layers.{index}.{name}.weight"]
            return rms_norm(x, weight, self.config.rms_norm_eps)

        x = norm("input_layernorm", h)
        h = h + norm("post_self_attn_layernorm", self._attention_block(index, pieces, x, plan, kv))
        x = norm("post_attention_layernorm", h)
        return h + norm("post_mlp_layernorm", self._mlp_block(index, pieces, x, plan))
