"""A loaded rank model's served weights by piece, as tests compare them with the checkpoint's."""

from __future__ import annotations

ATTENTION = ("w_qkv", "b_qkv", "w_o")  # a PieceAttention's (tpserve/ranks/layers/attention.py)


def piece_weight(layer, index: int, name: str):
    """Decoder layer `layer`'s piece `index`'s weight `name`: w_qkv, b_qkv or w_o of its attention,
    w_gate_up or w_down of its MLP."""
    part = layer.self_attn if name in ATTENTION else layer.mlp
    return getattr(part.pieces[index], name)


def piece_products(layer, index: int) -> list:
    """Piece `index`'s computed weights: its attention's, then its MLP's or experts'."""
    return layer.self_attn.pieces[index].products() + layer.mlp.pieces[index].products()
