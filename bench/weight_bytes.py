"""How many weight bytes one decode step reads on a rank, from the sharding plan: the numerator of
every bandwidth roofline the benchmarks draw."""

from __future__ import annotations

import math

from tpserve.ranks.model_config import ModelConfig
from tpserve.ranks.sharding import Split, piece_range, pieces_of_rank, rule_for
from tpserve.ranks.weight_names import expected_shape, required_names

ELEMENT_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes_per_token(config: ModelConfig, tp_rank: int, tp_size: int, element_size: int) -> int:
    """Weight bytes one decode step reads on this rank, from the sharding plan.

    Every layer weight of the rank's pieces, the replicated norms, and its vocabulary slice of the
    head (read whole to compute the logits; with tied embeddings that is the embedding table). An
    untied embedding table is only looked up, one row per token.
    """
    total = 0
    for name in required_names(config):
        shape = expected_shape(config, name)
        split, unit = rule_for(name)
        if split is Split.REPLICATED:
            total += math.prod(shape)
            continue
        for piece in pieces_of_rank(config, tp_rank, tp_size):
            start, end = piece_range(config, piece, unit)
            if name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
                total += config.hidden_size
            elif split is Split.ROW:
                total += shape[0] * (end - start)
            else:
                total += (end - start) * math.prod(shape[1:])
    return total * element_size
