"""Builds one rank's model from a model directory: config, sharding plan, weights."""

from __future__ import annotations

from pathlib import Path

import torch

from tpserve.kernels.collectives import Collectives
from tpserve.ranks.model import TPModel
from tpserve.ranks.model_config import ModelConfig, load_model_config
from tpserve.ranks.models.gemma3 import Gemma3Model
from tpserve.ranks.models.glm4v import Glm4vModel
from tpserve.ranks.models.gpt_oss import GptOssModel
from tpserve.ranks.models.llama import LlamaModel
from tpserve.ranks.models.moe import MoeModel
from tpserve.ranks.settings import DTYPE_NAMES
from tpserve.ranks.sharding import pieces_of_rank
from tpserve.ranks.unsupported import check_served_context
from tpserve.ranks.weights import read_rank_weights

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # name -> torch dtype
# A family (tpserve/ranks/model_config.py FAMILIES, and the vision-language models' text decoders) ->
# its decoder's file (tpserve/ranks/models/).
FAMILY_MODELS = {
    "llama": LlamaModel,
    "mistral": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "phi3": LlamaModel,
    "mixtral": MoeModel,
    "qwen3_moe": MoeModel,
    "qwen2_moe": MoeModel,
    "glm4_moe": MoeModel,
    "gpt_oss": GptOssModel,
    "gemma3": Gemma3Model,
    "glm4v": Glm4vModel,
}


def load_rank_model(
    model_dir: str | Path,
    *,
    tp_rank: int,
    tp_size: int,
    dtype: torch.dtype,
    max_positions: int,
    collectives: Collectives | None = None,
    config: ModelConfig | None = None,
    row_tile: int = 0,
    device="cpu",
    quantize: str = "none",
) -> TPModel:
    config = config or load_model_config(model_dir)
    # max_positions is the served context: a sliding window shorter than it is refused
    check_served_context(
        config.architecture, config.sliding_window, config.rope_scaling, max_positions, model_dir
    )
    pieces = pieces_of_rank(config, tp_rank, tp_size)
    weights = read_rank_weights(model_dir, config, pieces, dtype, device)
    return FAMILY_MODELS[config.family](
        config,
        weights,
        pieces,
        tp_rank=tp_rank,
        tp_size=tp_size,
        collectives=collectives,
        max_positions=max_positions,
        row_tile=row_tile,
        quantize=quantize,
    )
