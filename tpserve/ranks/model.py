"""The tensor-parallel decoder: one rank's pieces of a Llama-family model.

Every layer is computed piece by piece (see sharding.py). Row-parallel partial sums are added in
float32, then all-reduced across ranks; the embedding is vocab-parallel and all-reduced; the head
is vocab-parallel and its logits are gathered to rank 0 only. At tp=1 no collective is called.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tpserve.kernels.attention import SpanView, kv_slots, write_kv
from tpserve.kernels.attention_kernels import TILED, AttentionKernel, choose_attention
from tpserve.kernels.collectives import Collectives
from tpserve.kernels.embedding import place_features
from tpserve.kernels.int8_linear import PackedWeight
from tpserve.kernels.linear import linear
from tpserve.kernels.norms import rms_norm
from tpserve.kernels.q6_linear import Q6Weight
from tpserve.kernels.q8_linear import Q8Weight
from tpserve.kernels.rotary import Rotary
from tpserve.kernels.weight_formats import served_as
from tpserve.ranks.block_tensors import BlockValues
from tpserve.ranks.fp8_tensors import Fp8Values
from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.moe import PieceExperts, Router
from tpserve.ranks.mrope import MRotary
from tpserve.ranks.packing import fuse, pack_weight
from tpserve.ranks.partial_rotary import reorder_heads
from tpserve.ranks.sharding import Piece, split_evenly
from tpserve.ranks.weights import RankWeights

ROW_TABLES = (Q8Weight, Q6Weight)  # packed weights whose rows an embedding reads (`rows(ids)`)


class PieceLayer:
    """One layer's weights for one piece: fused q/k/v and gate/up, and the row-parallel halves."""

    def __init__(
        self,
        config: ModelConfig,
        piece: Piece,
        tensors: dict[str, torch.Tensor],
        prefix: str,
        quantize: str,
        dtype: torch.dtype,
        layer: int = 0,
    ):
        self.num_kv_heads = piece.num_kv_heads()
        self.num_q_heads = self.num_kv_heads * config.num_queries_per_kv
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        # The fused copies replace the loaded ones, which are taken out of `tensors` so that no
        # second copy outlives loading (room is measured after it); so do quantized ones.
        # A weight an int8 checkpoint ships in int8, or a GGUF in blocks, is served as stored
        # where its format allows (tpserve/ranks/packing.py).
        formats = served_as(quantize)
        q = functools.partial(pack_weight, kind=formats.linear, dtype=dtype)
        self.w_qkv = q(fuse(tensors, [attn + f"{n}_proj.weight" for n in "qkv"]))  # [(Hq+2Hkv)*D, hidden]
        self.b_qkv = fuse(tensors, [attn + f"{n}_proj.bias" for n in "qkv"]) if config.qkv_bias else None
        self.w_o = q(tensors.pop(attn + "o_proj.weight"))  # [hidden, Hq*D]
        # A sparse layer's MLP is its experts' slices (tpserve/ranks/moe.py), a dense one's gate/up and down.
        self.experts = self.w_gate_up = self.w_down = None
        if config.moe is not None and config.moe.is_sparse(layer):
            self.experts = PieceExperts(config.moe, layer, tensors, quantize, dtype)
            return
        self.w_gate_up = q(fuse(tensors, [mlp + "gate_proj.weight", mlp + "up_proj.weight"]))
        # (tpserve/kernels/weight_formats.py: down_proj and the head may be served in another format; a
        # checkpoint's int8 down_proj stays int8)
        self.w_down = pack_weight(
            tensors.pop(mlp + "down_proj.weight"), formats.down, dtype
        )  # [hidden, I_piece]

    def mlp_products(self) -> list:
        return self.experts.products() if self.experts else [self.w_gate_up, self.w_down]

    def probed_mlp(self) -> list[tuple[str, object]]:
        """The MLP products the start-up probe checks (one expert's stand for all)."""
        return self.experts.probed() if self.experts else [("gate_up", self.w_gate_up), ("down", self.w_down)]

    def products(self) -> list:
        """The layer's computed weights (a piece holding no KV head computes no q/k/v nor o)."""
        attention = [self.w_qkv, self.w_o] if self.num_kv_heads else []
        return [*attention, *self.mlp_products()]


class PassPlan:
    """What every layer of one pass shares, built once: the KV slots its tokens write (through their
    spans' block tables, in blocks of block_size slots), the rotary tables of its positions and what
    the attention kernel reads (its plan: tpserve/kernels/attention_kernels.py).

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
        self.attention = model.attention.plan(
            spans, group, num_slots, block_size, model.device, self.num_rows
        )


class TPModel:
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
        self.replicated = weights.replicated
        self.dtype, self.device = weights.dtype, next(iter(weights.replicated.values())).device
        self.layers = [
            [
                PieceLayer(
                    config, piece, weights.pieces[i], f"model.layers.{layer}.", quantize, self.dtype, layer
                )
                for i, piece in enumerate(pieces)
            ]
            for layer in range(config.num_layers)
        ]
        moe, replicated = config.moe, weights.replicated  # a sparse layer's router, None for a dense layer
        self.routers = [
            Router(
                moe,
                replicated[moe.router_name(layer)],
                replicated[moe.router_bias_name(layer)] if moe.biased else None,
                replicated[moe.correction_name(layer)] if moe.grouped else None,
                replicated[moe.shared_gate_name(layer)] if moe.shared_gate else None,
            )
            if moe and moe.is_sparse(layer)
            else None
            for layer in range(config.num_layers)
        ]
        # [layer][local piece]: the sink logits of the piece's query heads [Hq_piece] (gpt-oss's)
        self.layer_sinks: list[list[torch.Tensor]] | None = None
        head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        head_format = served_as(quantize).head
        self.head = [pack_weight(w[head_name], head_format, self.dtype) for w in weights.pieces]
        # [V_piece, hidden] each: the head's own copy where they are tied and it has rows to look
        # up (float, or 8- or 6-bit blocks), else its own (8-bit blocks where the head is, else float).
        embed, tied = "model.embed_tokens.weight", config.tie_word_embeddings
        if tied and all(isinstance(h, (torch.Tensor, *ROW_TABLES)) for h in self.head):
            self.embed = self.head
        else:
            self.embed = [_table(w[embed], head_format, self.dtype) for w in weights.pieces]
        # Logits are gathered in equal-sized chunks: pad each rank's share to the largest.
        rank_vocab = split_evenly(config.vocab_size, tp_size)
        self.gather_width = max(end - start for start, end in rank_vocab)
        self.max_positions = max_positions
        rotary_args = (config.head_dim, config.rope_theta, config.rope_scaling, max_positions, self.device)
        section = getattr(config.vision, "mrope_section", None)  # a Qwen-VL's positions are (t, h, w)
        interleaved = getattr(config.vision, "mrope_interleaved", False)
        self.rotary = (
            MRotary(section, *rotary_args, interleaved=interleaved, rotary_dim=config.rotary_dim)
            if section
            else Rotary(*rotary_args, rotary_dim=config.rotary_dim)
        )
        # Qwen3-VL: the first num_deepstack layers' outputs take more features at the media's rows
        self.num_deepstack = getattr(config.vision, "num_deepstack", 0)
        self.local_rotary: Rotary | None = None  # a family's own rotary for its sliding layers
        # a family whose image tokens see each other (Gemma 3): the engine names each pass's images
        # in its spans (SpanView.images), which the attention kernels read
        self.images_see_each_other = False
        self.scale = config.head_dim**-0.5
        self.activation = F.silu  # the MLP's gate: SwiGLU
        self.row_tile = row_tile  # see tpserve/kernels/linear.py: batch-invariant products
        self.attention = attention or choose_attention(
            bool(row_tile), config.head_dim, config.num_queries_per_kv, self.dtype, self.device
        )
        # Packed products give a row the same bits at any batch (tpserve/kernels/int8_linear.py): only float
        # layer weights need a pass padded to whole tiles (the head tiles its own rows).
        products = [w for pieces in self.layers for layer in pieces for w in layer.products()]
        self.pad_rows = row_tile if any(not isinstance(w, PackedWeight) for w in products) else 0

    def serve_attention_tiled(self) -> None:
        """Attention by tiled BLAS products from now on: where another rank has no C kernel."""
        self.attention = TILED

    def weight_bytes(self) -> int:
        """Bytes this rank's weights hold: every tensor and packed weight once (a tied head and
        embedding share theirs)."""
        held = [*self.replicated.values(), *self.head, *self.embed]
        for pieces in self.layers:
            for layer in pieces:
                held += [w for w in (layer.w_qkv, layer.b_qkv, layer.w_o) if w is not None]
                held += layer.mlp_products() + (layer.experts.biases() if layer.experts else [])
        unique = {id(w): w for w in held}.values()
        return sum(w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size() for w in unique)

    def kv_heads_per_piece(self) -> list[int]:
        """KV heads of each of this rank's pieces: the KV store's shape (tpserve/ranks/kv_store.py)."""
        return [piece.num_kv_heads() for piece in self.pieces]

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        # partial: [T, hidden] float32, already summed over this rank's pieces.
        if self.tp_size > 1:
            self.collectives.all_reduce_sum(partial)
        return partial if partial.dtype == self.dtype else partial.to(self.dtype)

    def _embed(self, token_ids: torch.Tensor, media_rows, media) -> torch.Tensor:
        """[T, hidden], or with media on a deepstack model [T, hidden * (1 + num_deepstack)]: the media's
        deepstack features ride the embedding's all-reduce (rank 0's, zeros elsewhere: exact at any tp)."""
        out = self._token_embeddings(token_ids, media_rows)
        if media_rows is not None:
            place_features(out, media_rows, media)
        return self._reduce(out)

    def _token_embeddings(self, token_ids: torch.Tensor, media_rows) -> torch.Tensor:
        """This rank's share of the token embeddings, float32 (each token's row from the one piece
        that owns it, zeros elsewhere), before the media's features go in and the all-reduce."""
        deepstack = self.num_deepstack if media_rows is not None else 0
        out = torch.zeros(
            token_ids.shape[0],
            self.config.hidden_size * (1 + deepstack),
            dtype=torch.float32,
            device=self.device,
        )
        for piece, table in zip(self.pieces, self.embed):
            start, end = piece.vocab
            owned = (token_ids >= start) & (token_ids < end)
            local = (token_ids - start).clamp(0, end - start - 1)
            out[:, : self.config.hidden_size] += _lookup(table, local).float() * owned.unsqueeze(1)
        return out

    def _attention(
        self, layer: PieceLayer, x, plan: PassPlan, pool_k, pool_v, qk_norms, window: int, sinks=None
    ) -> torch.Tensor:
        # window: the layer's sliding window (0: it sees every earlier token); a sliding layer
        # rotates by the family's local rotary where it has one; sinks: [Hq_piece] or None
        cfg, num_rows = self.config, x.shape[0]
        rotary, tables = self.rotary, plan.rotary
        if window and self.local_rotary is not None:
            rotary, tables = self.local_rotary, plan.local_rotary
        qkv = linear(x, layer.w_qkv, layer.b_qkv, self.row_tile, plan.num_tokens)
        num_q, num_kv = layer.num_q_heads, layer.num_kv_heads
        if self.attention.rotate_store_attend is not None:  # one call from here to the o product
            normed = None  # q and k read from qkv itself, unless normed first
            if qk_norms is not None:
                heads = qkv.view(num_rows, num_q + 2 * num_kv, cfg.head_dim)
                normed = (
                    rms_norm(heads[:, :num_q], qk_norms[0], cfg.rms_norm_eps),
                    rms_norm(heads[:, num_q : num_q + num_kv], qk_norms[1], cfg.rms_norm_eps),
                )
            attended = self.attention.rotate_store_attend(
                qkv,
                num_q,
                normed,
                tables,
                plan.slots,
                pool_k,
                pool_v,
                plan.attention,
                self.scale,
                window,
                sinks,
            )
            return linear(attended, layer.w_o, None, self.row_tile, plan.num_tokens)
        heads = qkv.view(num_rows, num_q + 2 * num_kv, cfg.head_dim)  # q heads, k heads, v heads
        if qk_norms is None:  # q and k rotated together
            q, k = rotary.apply(heads[:, : num_q + num_kv], tables).split((num_q, num_kv), dim=1)
        else:
            q = rotary.apply(rms_norm(heads[:, :num_q], qk_norms[0], cfg.rms_norm_eps), tables)
            k = rotary.apply(
                rms_norm(heads[:, num_q : num_q + num_kv], qk_norms[1], cfg.rms_norm_eps), tables
            )
        v = heads[:, num_q + num_kv :]
        real = plan.num_tokens
        write_kv(pool_k, pool_v, k[:real] if plan.padding else k, v[:real] if plan.padding else v, plan.slots)
        attended = self.attention.attend(q, pool_k, pool_v, plan.attention, self.scale, window, sinks)
        return linear(attended, layer.w_o, None, self.row_tile, plan.num_tokens)

    def _mlp(self, layer: PieceLayer, x: torch.Tensor, plan: PassPlan, routes) -> torch.Tensor:
        if layer.experts is not None:  # routes: the layer's Routes (tpserve/ranks/moe.py)
            return layer.experts.forward(x, routes, plan.num_tokens, self.row_tile)
        gate, up = linear(x, layer.w_gate_up, None, self.row_tile, plan.num_tokens).chunk(2, dim=-1)
        return linear(self.activation(gate) * up, layer.w_down, None, self.row_tile, plan.num_tokens)

    def _sum_pieces(self, outputs, rows: torch.Tensor) -> torch.Tensor:
        """The row-parallel partial sums of this rank's pieces, in piece order, in float32 (zeros
        shaped like `rows` where no piece has any: a rank holding no KV head of a layer)."""
        total = None
        for out in outputs:
            out = out if out.dtype == torch.float32 else out.float()
            total = out if total is None else total + out
        return torch.zeros(rows.shape, dtype=torch.float32, device=rows.device) if total is None else total

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
        cfg, replicated = self.config, self.replicated
        if plan.padding:  # padding rows read token 0; their results are dropped
            token_ids = F.pad(token_ids, (0, plan.padding))
        h = self._embed(token_ids, media_rows, media)  # [rows, hidden], or wider: see _embed
        deepstack = ()
        if h.shape[1] > cfg.hidden_size:
            h, *deepstack = (part.contiguous() for part in h.split(cfg.hidden_size, dim=1))
        for index, pieces in enumerate(self.layers):
            h = self._layer(index, pieces, h, plan, kv)
            if index < len(deepstack):  # as transformers: added to the layer's output at the media's rows
                h = h.index_add(0, media_rows, deepstack[index].index_select(0, media_rows))
        last = rms_norm(h[logit_rows], replicated["model.norm.weight"], cfg.rms_norm_eps)
        return self._logits(last)

    def _layer(self, index: int, pieces: list[PieceLayer], h, plan: PassPlan, kv) -> torch.Tensor:
        """One decoder layer (Llama's): pre-norm attention and MLP, each added to the residual."""
        cfg, replicated, prefix = self.config, self.replicated, f"model.layers.{index}."
        x = rms_norm(h, replicated[prefix + "input_layernorm.weight"], cfg.rms_norm_eps)
        h = h + self._attention_block(index, pieces, x, plan, kv)
        x = rms_norm(h, replicated[prefix + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        return h + self._mlp_block(index, pieces, x, plan)

    def _normed_layer(
        self, index: int, pieces, h, plan: PassPlan, kv, norms: tuple[str, ...]
    ) -> torch.Tensor:
        """A layer whose attention and MLP are each normed before and after, each then added to the
        residual (Gemma 3's, GLM-4.1V's); norms: the four norms' names (before the attention, after it,
        before the MLP, after it)."""

        def norm(name: str, x: torch.Tensor) -> torch.Tensor:
            weight = self.replicated[f"model.layers.{index}.{name}.weight"]
            return rms_norm(x, weight, self.config.rms_norm_eps)

        x = norm(norms[0], h)
        h = h + norm(norms[1], self._attention_block(index, pieces, x, plan, kv))
        x = norm(norms[2], h)
        return h + norm(norms[3], self._mlp_block(index, pieces, x, plan))

    def _attention_block(self, index: int, pieces: list[PieceLayer], x, plan: PassPlan, kv) -> torch.Tensor:
        """Layer `index`'s attention of normed x over its pieces, all-reduced: [rows, hidden]."""
        prefix = f"model.layers.{index}."
        qk_norms = None
        if self.config.qk_norm:
            qk_norms = (
                self.replicated[prefix + "self_attn.q_norm.weight"],
                self.replicated[prefix + "self_attn.k_norm.weight"],
            )
        window = self.config.windows[index] if self.config.windows else 0
        sinks = self.layer_sinks[index] if self.layer_sinks else [None] * len(pieces)
        attended = (
            self._attention(layer, x, plan, *kv.layer(local, index), qk_norms, window, sinks[local])
            for local, layer in enumerate(pieces)
            if layer.num_kv_heads
        )
        return self._reduce(self._sum_pieces(attended, x))

    def _mlp_block(self, index: int, pieces: list[PieceLayer], x, plan: PassPlan) -> torch.Tensor:
        """Layer `index`'s MLP (or experts) of normed x over its pieces, all-reduced: [rows, hidden]."""
        router = self.routers[index]
        routes = router.route(x, plan.num_tokens, self.row_tile) if router else None
        mlp = (self._mlp(layer, x, plan, routes) for layer in pieces)
        return self._reduce(self._sum_pieces(mlp, x))

    def _logits(self, last: torch.Tensor) -> torch.Tensor | None:
        """The head's logits of the final-normed rows: float32 [n, vocab] on rank 0, None elsewhere."""
        cfg = self.config
        local = torch.cat(
            [linear(last, head, None, self.row_tile) for head in self.head], dim=-1
        )  # [n, V_rank]
        if self.tp_size == 1:
            return local.float()
        padded = F.pad(local, (0, self.gather_width - local.shape[1]))
        chunks = self.collectives.gather_to_first(padded)
        if chunks is None:
            return None
        widths = [end - start for start, end in split_evenly(cfg.vocab_size, self.tp_size)]
        return torch.cat([chunk[:, :width] for chunk, width in zip(chunks, widths)], dim=-1).float()


def _lookup(table: torch.Tensor | Q8Weight | Q6Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table: [n, hidden]."""
    return table.rows(ids) if isinstance(table, ROW_TABLES) else F.embedding(ids, table)


def _table(
    weight: torch.Tensor | BlockValues, head_format: str, dtype: torch.dtype
) -> torch.Tensor | Q8Weight | Q6Weight:
    """An embedding table of its own: 8-bit blocks where the head is in them (6-bit ones where the file
    keeps it in Q6_K), else float."""
    packed = pack_weight(weight, "q8") if head_format == "q8" else None
    return packed if isinstance(packed, ROW_TABLES) else _float(weight, dtype)


def _float(weight: torch.Tensor | BlockValues | Fp8Values, dtype: torch.dtype) -> torch.Tensor:
    return weight.dequantize().to(dtype) if isinstance(weight, (BlockValues, Fp8Values)) else weight
