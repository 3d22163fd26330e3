"""The tensor-parallel decoder's skeleton: one rank's pieces of a model, and one pass through them.

A family's file (tpserve/ranks/models/) composes its layers from the shared layer objects
(tpserve/ranks/layers/): the vocab-parallel embedding, decoder layers of attention and MLP, the final
norm and the vocab-parallel head. Each layer's row-parallel partial sums are added in float32, then
all-reduced across ranks; the embedding is all-reduced; the head's logits are gathered to rank 0
only. At tp=1 no collective is called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.kernels.attention import SpanView, kv_slots
from tpserve.kernels.attention_kernels import TILED, AttentionKernel, choose_attention
from tpserve.kernels.collectives import Collectives
from tpserve.kernels.rotary import Rotary
from tpserve.kernels.tensor_parallel import RankGroup
from tpserve.kernels.weight_formats import held_bytes, is_packed
from tpserve.ranks.layers.decoder import DecoderLayer
from tpserve.ranks.layers.norm import RMSNorm
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.layers.vocab import VocabEmbedding, VocabHead
from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.mrope import MRotary
from tpserve.ranks.partial_rotary import reorder_heads
from tpserve.ranks.sharding import Piece
from tpserve.ranks.weights import RankWeights


class PassPlan:
    """What every layer of one pass shares, built once: the KV slots its tokens write (through their
    spans' block tables, in blocks of block_size slots), the rotary tables of its positions, the
    attention kernel and what it reads (its plan: tpserve/kernels/attention_kernels.py).

    In batch-invariant mode with float weights the pass's rows are padded once to whole row tiles
    (tpserve/kernels/linear.py), so every layer's products run on them as they are; the padding rows are never
    written to the KV pool nor read back as logits. Packed (int8) products need no tiles: no padding.
    """

    def __init__(
        self, model: TPModel, spans: list[SpanView], positions: torch.Tensor, num_slots: int, block_size: int
    ):
        tile = model.pad_rows
        self.spans = spans
        self.num_tokens = positions.shape[-1]  # positions: [T], or [3, T] where they are multimodal
        self.num_rows = -(-self.num_tokens // tile) * tile if tile else self.num_tokens
        self.padding = self.num_rows - self.num_tokens
        self.slots = kv_slots(spans, block_size, model.device)
        padded = F.pad(positions, (0, self.padding)) if self.padding else positions
        self.rotary = model.rotary.tables(padded, model.dtype)
        # a family whose sliding layers rotate by a base of their own (Gemma 3): their tables
        local = model.local_rotary
        self.local_rotary = local.tables(padded, model.dtype) if local is not None else None
        group = model.config.num_queries_per_kv
        self.kernel = model.attention
        self.attention = model.attention.plan(
            spans, group, num_slots, block_size, model.device, self.num_rows
        )


class TPModel:
    """One rank's model. A family's subclass builds its parts in `build`; the pass is the same for all:
    embed, every decoder layer in order, the final norm of the rows whose logits are wanted, the head."""

    def __init__(
        self,
        config: ModelConfig,
        weights: RankWeights,
        pieces: list[Piece],
        *,
        tp_rank: int,
        tp_size: int,
        collectives: Collectives | None = None,
        max_positions: int,
        row_tile: int = 0,
        quantize: str = "none",
        attention: AttentionKernel | None = None,
    ):
        self.config = config
        self.pieces = pieces
        if config.rotary_dim or config.rotary_interleaved:  # q's and k's head dims reordered before packing
            reorder_heads(config, weights, pieces)
        self.tp_rank, self.tp_size, self.collectives = tp_rank, tp_size, collectives
        self.dtype, self.device = weights.dtype, next(iter(weights.replicated.values())).device
        self.max_positions = max_positions
        self.row_tile = row_tile  # see tpserve/kernels/linear.py: batch-invariant products
        rotary_args = (config.head_dim, config.rope_theta, config.rope_scaling, max_positions, self.device)
        section = getattr(config.vision, "mrope_section", None)  # a Qwen-VL's positions are (t, h, w)
        interleaved = getattr(config.vision, "mrope_interleaved", False)
        self.rotary = (
            MRotary(section, *rotary_args, interleaved=interleaved, rotary_dim=config.rotary_dim)
            if section
            else Rotary(*rotary_args, rotary_dim=config.rotary_dim)
        )
        self.local_rotary: Rotary | None = None  # a family's own rotary for its sliding layers
        # Qwen3-VL: the first num_deepstack layers' outputs take more features at the media's rows
        self.num_deepstack = getattr(config.vision, "num_deepstack", 0)
        # a family whose image tokens see each other (Gemma 3): the engine names each pass's images
        # in its spans (SpanView.images), which the attention kernels read
        self.images_see_each_other = False
        self.attention = attention or choose_attention(
            bool(row_tile), config.head_dim, config.num_queries_per_kv, self.dtype, self.device
        )
        group = RankGroup(tp_rank, tp_size, collectives, self.dtype)
        shard = Shard(config, weights, pieces, quantize, row_tile, group)
        self.embed_tokens, self.layers, self.norm, self.lm_head = self.build(shard)
        # Packed products give a row the same bits at any batch (tpserve/kernels/int8_linear.py): only float
        # layer weights need a pass padded to whole tiles (the head tiles its own rows).
        products = [w for layer in self.layers for w in layer.products()]
        self.pad_rows = row_tile if any(not is_packed(w) for w in products) else 0

    def build(self, shard: Shard) -> tuple[VocabEmbedding, list[DecoderLayer], RMSNorm, VocabHead]:
        """The family's parts: the embedding, the decoder layers in order, the final norm, the head."""
        raise NotImplementedError(f"{type(self).__name__} builds no decoder")

    def serve_attention_tiled(self) -> None:
        """Attention by tiled BLAS products from now on: where another rank has no C kernel."""
        self.attention = TILED

    def weight_bytes(self) -> int:
        """Bytes this rank's weights hold: every tensor and packed weight once (a tied head and
        embedding share theirs)."""
        held = [*self.embed_tokens.tables, *self.lm_head.weights, self.norm.weight]
        held += [w for layer in self.layers for w in layer.held()]
        return sum(held_bytes(w) for w in {id(w): w for w in held}.values())

    def kv_heads_per_piece(self) -> list[int]:
        """KV heads of each of this rank's pieces: the KV store's shape (tpserve/ranks/kv_store.py)."""
        return [piece.num_kv_heads() for piece in self.pieces]

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spans: list[SpanView],
        kv,
        logit_rows: list[int],
        media_rows: torch.Tensor | None = None,
        media: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """token_ids: [T]; positions: [T] ([3, T] for a multimodal rotary: tpserve/ranks/mrope.py); kv: the KV
        pool; logit_rows: packed rows whose next-token logits are wanted. media_rows: [M] packed rows whose
        embedding is an image feature instead of their token's; media: those features [M, hidden] on rank 0
        (None elsewhere). Returns float32 logits [len(logit_rows), vocab] on rank 0, None elsewhere."""
        plan = PassPlan(self, spans, positions, kv.num_slots, kv.block_size)
        return self.forward_planned(token_ids, plan, kv, logit_rows, media_rows, media)

    def forward_planned(
        self, token_ids: torch.Tensor, plan, kv, logit_rows: list[int] | slice, media_rows=None, media=None
    ) -> torch.Tensor | None:
        """forward on a plan built already: a PassPlan, or a graphed decode round's (tpserve/ranks/
        decode_graphs.py RoundPlan, whose logit rows are a slice: no index built from a list)."""
        hidden = self.config.hidden_size
        if plan.padding:  # padding rows read token 0; their results are dropped
            token_ids = F.pad(token_ids, (0, plan.padding))
        # [rows, hidden]; with media on a deepstack model the media's deepstack features beside it
        width = hidden * (1 + (self.num_deepstack if media_rows is not None else 0))
        h = self.embed_tokens.forward(token_ids, width, media_rows, media)
        deepstack = ()
        if width > hidden:
            h, *deepstack = (part.contiguous() for part in h.split(hidden, dim=1))
        for index, layer in enumerate(self.layers):
            h = layer.forward(h, plan, kv)
            if index < len(deepstack):  # as transformers: added to the layer's output at the media's rows
                h = h.index_add(0, media_rows, deepstack[index].index_select(0, media_rows))
        return self.lm_head.forward(self.norm.forward(h[logit_rows]))
