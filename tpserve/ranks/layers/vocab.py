"""The vocab-parallel ends of the decoder: the embedding and the head, each piece owning a range of
the vocabulary's rows.

The embedding's pieces look up the tokens they own (zeros for the others), their sums all-reduced;
the head's pieces compute their vocabulary's logits, gathered to rank 0 only. Where the embeddings
are tied and the head's tables can be read by rows (float, or 8- or 6-bit blocks), the embedding
reads the head's; else it keeps a table of its own.
"""

from __future__ import annotations

import torch

from tpserve.kernels.embedding import place_features
from tpserve.kernels.linear import linear
from tpserve.kernels.weight_formats import embedding_rows, has_rows
from tpserve.ranks.layers.shard import Shard
from tpserve.ranks.packing import pack_embedding, pack_weight
from tpserve.ranks.sharding import split_evenly

EMBED = "model.embed_tokens.weight"


class VocabHead:
    """softcap: logits soft-capped as cap * tanh(logits / cap) (Gemma 3's final_logit_softcapping)."""

    def __init__(self, shard: Shard, softcap: float | None = None):
        config = shard.config
        name = EMBED if config.tie_word_embeddings else "lm_head.weight"
        # [V_piece, hidden] each
        self.weights = [pack_weight(w[name], shard.formats.head, shard.dtype) for w in shard.weights.pieces]
        self.widths = [end - start for start, end in split_evenly(config.vocab_size, shard.group.tp_size)]
        self.softcap, self.row_tile, self.group = softcap, shard.row_tile, shard.group

    def forward(self, last: torch.Tensor) -> torch.Tensor | None:
        """last: [n, hidden], the final-normed rows -> float32 logits [n, vocab] on rank 0, None elsewhere."""
        local = torch.cat([linear(last, w, None, self.row_tile) for w in self.weights], dim=-1)  # [n, V_rank]
        logits = self.group.gather_logits(local, self.widths)
        if logits is None or self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


class VocabEmbedding:
    """scale: the token embeddings' factor (Gemma 3's sqrt(hidden_size)), in the model's dtype."""

    def __init__(self, shard: Shard, head: VocabHead, scale: float | None = None):
        config = shard.config
        if config.tie_word_embeddings and all(has_rows(w) for w in head.weights):
            self.tables = head.weights  # one copy for both
        else:  # [V_piece, hidden] each
            self.tables = [
                pack_embedding(w[EMBED], shard.formats.head, shard.dtype) for w in shard.weights.pieces
            ]
        self.vocab = [piece.vocab for piece in shard.pieces]
        self.hidden_size, self.group, self.device = config.hidden_size, shard.group, shard.device
        # rounded to the model's dtype as the reference's, then held in float32 (the rows' dtype here)
        self.scale = None if scale is None else torch.tensor(scale, dtype=shard.dtype).float()

    def forward(self, token_ids: torch.Tensor, width: int, media_rows=None, media=None) -> torch.Tensor:
        """token_ids: [T] -> [T, width] in the model's dtype: the embeddings in the first hidden_size
        columns; media_rows [M] take rank 0's media [M, width] instead (a deepstack model's features
        riding the same all-reduce: rank 0's, zeros elsewhere, exact at any tp)."""
        out = torch.zeros(token_ids.shape[0], width, dtype=torch.float32, device=self.device)
        for (start, end), table in zip(self.vocab, self.tables):
            owned = (token_ids >= start) & (token_ids < end)
            local = (token_ids - start).clamp(0, end - start - 1)
            out[:, : self.hidden_size] += embedding_rows(table, local).float() * owned.unsqueeze(1)
        if self.scale is not None:
            # Before the media's features go in, which are not scaled (as transformers' scatter).
            # Each row has one nonzero share, so scaling before the all-reduce gives the bits of
            # scaling after it; in float32 the product of two narrower numbers is exact, rounded
            # once as theirs.
            out *= self.scale
        if media_rows is not None:
            place_features(out, media_rows, media)
        return self.group.reduce(out)
