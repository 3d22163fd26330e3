"""The decoder layers' two shapes: Llama's pre-norm residual blocks, and the sandwich whose blocks are
normed both before and after (Gemma 3's, GLM-4's). The attention and the MLP (dense, or a mixture
of experts) each return their output reduced over every rank."""

from __future__ import annotations

import torch

from tpserve.ranks.layers.norm import RMSNorm


class DecoderLayer:
    """h + attention(norm(h)), then h + mlp(norm(h)) (Llama's)."""

    def __init__(self, self_attn, mlp, input_layernorm: RMSNorm, post_attention_layernorm: RMSNorm):
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm

    def forward(self, h: torch.Tensor, plan, kv) -> torch.Tensor:
        h = h + self.self_attn.forward(self.input_layernorm.forward(h), plan, kv)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h), plan)

    def norms(self) -> list[RMSNorm]:
        return [self.input_layernorm, self.post_attention_layernorm]

    def products(self) -> list:
        """The layer's computed weights, every piece's (row tiles and the probe read them)."""
        return self.self_attn.products() + self.mlp.products()

    def held(self) -> list:
        """Every weight the layer holds (for a rank's byte count)."""
        return self.self_attn.held() + self.mlp.held() + [norm.weight for norm in self.norms()]


class SandwichDecoderLayer(DecoderLayer):
    """h + norm(attention(norm(h))), then h + norm(mlp(norm(h))).

    norms: before the attention, after it, before the MLP, after it."""

    def __init__(self, self_attn, mlp, norms: tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm]):
        self.self_attn, self.mlp = self_attn, mlp
        self.pre_attention_norm, self.post_attention_norm, self.pre_mlp_norm, self.post_mlp_norm = norms

    def forward(self, h: torch.Tensor, plan, kv) -> torch.Tensor:
        attended = self.self_attn.forward(self.pre_attention_norm.forward(h), plan, kv)
        h = h + self.post_attention_norm.forward(attended)
        mlp = self.mlp.forward(self.pre_mlp_norm.forward(h), plan)
        return h + self.post_mlp_norm.forward(mlp)

    def norms(self) -> list[RMSNorm]:
        return [self.pre_attention_norm, self.post_attention_norm, self.pre_mlp_norm, self.post_mlp_norm]
